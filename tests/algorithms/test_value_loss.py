"""compute_value_loss forwards Dr.GRPO's norm_constant to agg_loss (seq-mean-token-sum-norm)."""
import torch

from mrl.algorithms import agg_loss, compute_value_loss


def _values(B=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    old = v + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ret = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).to(torch.float64)
    return v, old, ret, mask


def test_value_loss_sum_norm_uses_norm_constant_and_ignores_padding_width():
    """float64, rtol 1e-12: C = 20 fixed, the tensors padded from T = 7 to 12 with zero-mask columns."""
    v, old, ret, mask = _values()
    B, k, C = v.shape[0], 5, 20
    a = v.clone().requires_grad_(True)
    narrow, clip_n = compute_value_loss(a, ret, old, mask, 0.2, "seq-mean-token-sum-norm", norm_constant=C)
    narrow.backward()
    vclip = torch.clamp(v, old - 0.2, old + 0.2)
    want = 0.5 * agg_loss(torch.maximum((v - ret) ** 2, (vclip - ret) ** 2), mask, "seq-mean-token-sum-norm",
                          norm_constant=C)
    torch.testing.assert_close(narrow.detach(), want, rtol=1e-12, atol=0)

    g = torch.Generator().manual_seed(1)
    pad = lambda t: torch.cat([t, torch.randn(B, k, generator=g, dtype=torch.float64)], dim=-1)
    b = v.clone().requires_grad_(True)
    wide_mask = torch.cat([mask, torch.zeros(B, k, dtype=torch.float64)], dim=-1)
    wide, clip_w = compute_value_loss(pad(b), pad(ret), pad(old), wide_mask, 0.2, "seq-mean-token-sum-norm",
                                      norm_constant=C)
    wide.backward()
    torch.testing.assert_close(wide, narrow, rtol=1e-12, atol=0)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(clip_w, clip_n, rtol=1e-12, atol=0)
