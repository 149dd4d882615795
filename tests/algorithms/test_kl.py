"""KL estimators against their formulas; straight-through '+' variants carry the k2 gradient."""
import pytest
import torch

from mrl.algorithms import KL_PENALTY_NAMES, kl_penalty


def _lp(seed=0, shape=(6, 11), scale=1.0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=g, dtype=torch.float64) * 3 * scale
    ref = -torch.rand(shape, generator=g, dtype=torch.float64) * 3 * scale
    return lp, ref


FORMULAS = {
    "kl": lambda d: d,
    "k1": lambda d: d,
    "abs": lambda d: d.abs(),
    "mse": lambda d: 0.5 * d**2,
    "k2": lambda d: 0.5 * d**2,
    "low_var_kl": lambda d: (torch.exp(-d.clamp(-20, 20)) + d.clamp(-20, 20) - 1).clamp(-10, 10),
    "k3": lambda d: (torch.exp(-d.clamp(-20, 20)) + d.clamp(-20, 20) - 1).clamp(-10, 10),
}


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_estimator_matches_formula(name):
    lp, ref = _lp(scale=2.0)  # |d| up to 6: k3 hits its +10 clamp on some entries
    torch.testing.assert_close(kl_penalty(lp, ref, name), FORMULAS[name](lp - ref), rtol=1e-12, atol=1e-12)
    # '+' variants have the same forward value
    torch.testing.assert_close(kl_penalty(lp, ref, name + "+"), FORMULAS[name](lp - ref), rtol=1e-12, atol=1e-12)


def test_k1_sign_is_logprob_minus_ref_and_k3_is_nonnegative():
    lp, ref = torch.tensor([-0.1]), torch.tensor([-0.5])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(0.4)
    lp, ref = _lp(seed=1)
    assert (kl_penalty(lp, ref, "k3") >= 0).all()


def test_k3_clamps():
    lp = torch.tensor([0.0, 0.0], dtype=torch.float64)
    ref = torch.tensor([30.0, -30.0], dtype=torch.float64)  # d = -30 -> clamped to -20, result to 10
    # d=+30: exp(-20) + 20 - 1 = 19 -> 10; d=-30: exp(20) - 21 -> 10
    assert kl_penalty(lp, ref, "k3").tolist() == [10.0, 10.0]
    d = torch.tensor([-2.0, 2.0], dtype=torch.float64)  # inside the clamps: exact formula
    torch.testing.assert_close(kl_penalty(d, torch.zeros(2, dtype=torch.float64), "k3"), torch.exp(-d) + d - 1)


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_plus_variant_gradient_equals_k2_gradient(name):
    lp, ref = _lp(seed=2)
    w = torch.randn(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    a = lp.clone().requires_grad_(True)
    (kl_penalty(a, ref, name + "+") * w).sum().backward()
    b = lp.clone().requires_grad_(True)
    (kl_penalty(b, ref, "k2") * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a.grad, w * (lp - ref), rtol=1e-12, atol=1e-12)  # d/dlp of d^2/2 = d
    if name not in ("mse", "k2"):  # the plain estimator has a different gradient
        c = lp.clone().requires_grad_(True)
        (kl_penalty(c, ref, name) * w).sum().backward()
        assert not torch.allclose(c.grad, a.grad)


def test_full_is_refused_with_guidance_and_unknown_lists_names():
    lp, ref = _lp()
    with pytest.raises(ValueError, match="whole-vocabulary.*low_var_kl"):
        kl_penalty(lp, ref, "full")
    with pytest.raises(ValueError, match="whole-vocabulary"):
        kl_penalty(lp, ref, "full+")
    with pytest.raises(ValueError, match="kl_loss_type.*k3"):
        kl_penalty(lp, ref, "k4")
    assert "full" not in KL_PENALTY_NAMES and "k3+" in KL_PENALTY_NAMES
