"""Entropy (plain and chunked), clipped value loss and explained variance."""
import math

import pytest
import torch

from mrl.algorithms import (
    compute_value_loss,
    entropy_from_logits,
    entropy_from_logits_chunked,
    explained_variance,
)


def test_entropy_matches_definition_and_is_stable():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 17, generator=g, dtype=torch.float64) * 4
    p = torch.softmax(z, -1)
    torch.testing.assert_close(entropy_from_logits(z), -(p * p.log()).sum(-1), rtol=1e-12, atol=1e-12)
    big = torch.tensor([[1000.0, 0.0, -1000.0]], dtype=torch.float64)  # naive log(p) gives nan/-inf
    assert entropy_from_logits(big).item() == pytest.approx(0.0, abs=1e-12)
    uniform = torch.zeros(1, 300, dtype=torch.float64)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(300.0), rel=1e-12)


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_chunked_entropy_same_value_and_gradient(chunk):
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 9, 33, generator=g, dtype=torch.float64) * 3
    w = torch.randn(2, 9, generator=g, dtype=torch.float64)
    a = z.clone().requires_grad_(True)
    (entropy_from_logits(a) * w).sum().backward()
    b = z.clone().requires_grad_(True)
    h = entropy_from_logits_chunked(b, chunk_size=chunk)
    (h * w).sum().backward()
    torch.testing.assert_close(h, entropy_from_logits(z), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12)


def test_chunked_entropy_gradcheck():
    z = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits_chunked(x, chunk_size=2), (z,))


def test_value_loss_clipping_and_clipfrac():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0, 1.05, 9.0]], dtype=torch.float64)
    vpreds = torch.tensor([[1.5, 1.5, 1.1, 0.0]], dtype=torch.float64)  # eps_v = 0.2 -> clip to [0.8, 1.2]
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    vp = vpreds.clone().requires_grad_(True)
    loss, clipfrac = compute_value_loss(vp, returns, values, mask, cliprange_value=0.2)
    # token0: max((1.5-2)^2, (1.2-2)^2)=0.64 (clipped); token1: max(2.25, 1.44)=2.25; token2: max(.0025, .0025)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 2.25 + 0.0025) / 3, rel=1e-12)
    assert clipfrac.item() == pytest.approx(1 / 3)
    loss.backward()
    assert vp.grad[0, 0].item() == 0.0  # clipped branch has no gradient
    assert vp.grad[0, 1].item() == pytest.approx(0.5 * 2 * (1.5 - 0.0) / 3)
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(vpreds, returns, values, mask, cliprange_value=-1)


def test_explained_variance():
    g = torch.Generator().manual_seed(3)
    ret = torch.randn(4, 6, generator=g, dtype=torch.float64)
    m = torch.ones_like(ret)
    m[0, 3:] = 0
    assert explained_variance(ret, ret, m).item() == pytest.approx(1.0)
    mean_pred = torch.full_like(ret, ret[m.bool()].mean().item())
    assert explained_variance(ret, mean_pred, m).item() == pytest.approx(0.0, abs=1e-12)
    noisy = ret + 0.5 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    r, v = ret[m.bool()], noisy[m.bool()]
    assert explained_variance(ret, noisy, m).item() == pytest.approx(1 - (r - v).var().item() / r.var().item())
    const = torch.ones(2, 3)
    assert explained_variance(const, const, torch.ones(2, 3)).item() == 1.0
