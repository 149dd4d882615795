"""The losses and estimators added for verl parity against their papers' definitions, written out
directly here (the verl oracle is tests/algorithms/oracle/): gradients by autograd vs the closed
forms, objectives vs the papers' formulas, worked numbers for the estimators."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mrl.algorithms import get_adv_estimator, get_policy_loss_fn
from mrl.algorithms.policy_loss import PolicyLossParams

P = PolicyLossParams(tau_pos=1.0, tau_neg=1.05, clip_cov_ratio=0.1, clip_cov_lb=-1e9, clip_cov_ub=1e9,
                     kl_cov_ratio=0.1, ppo_kl_coef=0.5)
LOW, HIGH = 0.2, 0.28


def _data(seed=0, B=4, T=6):
    g = torch.Generator().manual_seed(seed)
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 2 + 0.05)
    new = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T) < torch.tensor([6, 4, 5, 2]).unsqueeze(1)).to(torch.float64)
    return old, new, adv, mask


def _grad(name, old, new, adv, mask, params=P, **kw):
    lp = new.clone().requires_grad_(True)
    kw = {"loss_agg_mode": "token-mean", "clip_ratio_low": LOW, "clip_ratio_high": HIGH, "clip_ratio_c": None} | kw
    out = get_policy_loss_fn(name)(old, lp, adv, mask, loss_params=params, **kw)
    out.pg_loss.backward()
    return out, lp.grad


def test_cispo_gradient_is_stopgrad_clipped_ratio_times_advantage():
    """MiniMax-M1 eq. (4): grad J = E[sg(clip(r, 1-eps_low, 1+eps_high)) A grad log pi] — clipped
    tokens keep a (bounded) gradient, unlike PPO."""
    old, new, adv, mask = _data()
    _, g = _grad("cispo", old, new, adv, mask)
    r = torch.exp(new - old)
    want = -torch.clamp(r, 1 - LOW, 1 + HIGH) * adv * mask / mask.sum()
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-14)
    assert ((r > 1 + HIGH) & (mask > 0)).any() and (g[(r > 1 + HIGH) & (mask > 0)] != 0).all()


def test_sapo_gradient_is_the_soft_gate_and_plain_pg_on_policy():
    """SAPO: J = E[f(r) A], f(r) = 4/tau sigmoid(tau (r - 1)) -> dJ/dlog pi = A 4 s(1-s) r; at r = 1
    the gate's slope is 1, i.e. the policy gradient."""
    old, new, adv, mask = _data(1)
    _, g = _grad("sapo", old, new, adv, mask, loss_agg_mode="seq-mean-token-mean")
    r = torch.exp(new - old)
    tau = torch.where(adv > 0, torch.tensor(P.tau_pos, dtype=adv.dtype), torch.tensor(P.tau_neg, dtype=adv.dtype))
    s = torch.sigmoid(tau * (r - 1))
    n = mask.sum(-1, keepdim=True)
    torch.testing.assert_close(g, -adv * 4 * s * (1 - s) * r * mask / n / mask.shape[0], rtol=1e-12, atol=1e-14)
    _, g1 = _grad("sapo", old, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(g1, -adv * mask / n / mask.shape[0], rtol=1e-12, atol=1e-14)


def test_gpg_is_plain_policy_gradient():
    old, new, adv, mask = _data(2)
    out, g = _grad("gpg", old, new, adv, mask)
    torch.testing.assert_close(g, -adv * mask / mask.sum(), rtol=1e-12, atol=1e-14)
    assert out.pg_loss.item() == pytest.approx(float(-(adv * new * mask).sum() / mask.sum()), rel=1e-12)


def test_geo_mean_is_gmpo_objective_of_the_paper():
    """GMPO eq. (5): J = 1/G sum_i sgn(A_i) prod_t |min(r_t A_i, clip(r_t, e^-eps_low, e^eps_high) A_i)|^(1/|o_i|)."""
    old, new, _, mask = _data(3)
    a_seq = torch.tensor([1.5, -0.7, 0.3, -2.0], dtype=torch.float64)
    adv = a_seq.unsqueeze(1) * mask
    out, _ = _grad("geo_mean", old, new, adv, mask, loss_agg_mode="seq-mean-token-mean")
    j = 0.0
    for i in range(4):
        n = int(mask[i].sum())
        r = torch.exp(new[i, :n] - old[i, :n])
        terms = torch.minimum(r * a_seq[i], torch.clamp(r, math.exp(-LOW), math.exp(HIGH)) * a_seq[i]).abs()
        j += float(torch.sign(a_seq[i]) * torch.prod(terms ** (1.0 / n)))
    assert out.pg_loss.item() == pytest.approx(-j / 4, rel=1e-7)  # verl's n + 1e-8 denominators


def test_clip_cov_detaches_exactly_the_drawn_tokens_and_is_ppo_elsewhere():
    """Clip-Cov: max(1, int(ratio * N)) tokens drawn among the unclipped ones lose their gradient;
    every other token has PPO's gradient (bounds here admit every token)."""
    old, new, adv, mask = _data(4)
    torch.manual_seed(0)
    out, g = _grad("clip_cov", old, new, adv, mask)
    _, g_ppo = _grad("vanilla", old, new, adv, mask)
    dropped = (g == 0) & (g_ppo != 0)
    assert int(dropped.sum()) == max(1, int(P.clip_cov_ratio * mask.sum()))
    torch.testing.assert_close(g[~dropped], g_ppo[~dropped], rtol=1e-12, atol=1e-14)
    assert out.pg_clipfrac.item() == pytest.approx(float(dropped.sum() / mask.sum()))


def test_kl_cov_penalises_the_top_covariance_tokens():
    """KL-Cov: L = -A r + coef |log r| on the k = max(1, int(ratio * N)) tokens of largest
    (A - mean A)(log pi - mean log pi) over valid tokens."""
    old, new, adv, mask = _data(5)
    out, _ = _grad("kl_cov", old, new, adv, mask)
    v = mask > 0
    a, lp = adv[v].numpy(), new[v].numpy()
    cov = (a - a.mean()) * (lp - lp.mean())
    k = max(1, int(P.kl_cov_ratio * v.sum()))
    top = np.argsort(-cov)[:k]
    loss = -(adv * torch.exp(new - old))[v].numpy()
    loss[top] += P.ppo_kl_coef * np.abs((new - old)[v].numpy()[top])
    assert out.pg_loss.item() == pytest.approx(loss.sum() / v.sum().item(), rel=1e-12)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_masks_by_probability_divergence(name):
    """DPPO-Binary: a token is dropped when the new probability moved beyond the trust region in the
    direction its advantage pushes (TV: |p - p_old|; KL: the binary KL of (p_old, p)); kept tokens get
    the truncated-IS gradient -A sg(min(r, c)) grad log pi."""
    old, new, adv, mask = _data(6)
    lo, hi, c = 0.03, 0.05, 1.5
    _, g = _grad(name, old, new, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c)
    want = torch.zeros_like(g)
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        p, q, a = math.exp(new[i, t]), math.exp(old[i, t]), float(adv[i, t])
        if name == "dppo_tv":
            keep = (p - q <= hi) if a > 0 else (p - q >= -lo)
        else:
            d = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            keep = (d <= hi or p <= q) if a > 0 else (d <= lo or p >= q)
        want[i, t] = -a * min(p / q, c) * keep
    torch.testing.assert_close(g, want / mask.sum(), rtol=1e-10, atol=1e-14)
    assert (want == 0).logical_and(mask > 0).any() and (want != 0).any()


def test_passk_opo_gpg_worked_examples():
    mask = torch.ones(6, 2, dtype=torch.float64)
    mask[1, 1] = 0  # sample 1 has one response token
    s = torch.tensor([3.0, 1.0, 2.0, 0.0, 5.0, 5.0], dtype=torch.float64)
    r = torch.zeros(6, 2, dtype=torch.float64)
    r[:, 0] = s
    idx = np.array([0, 0, 0, 0, 1, 1])
    adv, _ = get_adv_estimator("grpo_passk")(r, mask, index=idx)
    std = float(torch.std(s[:4]))
    assert adv[:, 0].tolist() == pytest.approx([(3 - 2) / (std + 1e-6), 0, 0, 0, 0, 0])  # tie 5, 5: 0 either way
    adv, _ = get_adv_estimator("opo")(r, mask, index=idx)
    b = (2 * 3 + 1 * 1 + 2 * 2 + 2 * 0) / 7  # length-weighted mean of group 0
    assert adv[:, 0].tolist() == pytest.approx([3 - b, 1 - b, 2 - b, -b, 0, 0])
    adv, _ = get_adv_estimator("gpg")(r, mask, index=idx)
    alpha = 6 / 5  # five non-zero scores
    assert adv[:, 0].tolist() == pytest.approx([alpha * (x - 1.5) for x in (3, 1, 2, 0)] + [0, 0])
