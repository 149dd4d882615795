"""agg_loss formulas and exact micro-batch invariance with global denominators."""
import pytest
import torch

from mrl.algorithms import LOSS_AGG_MODES, agg_loss, count_tokens_and_seqs


def _batch(B=10, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    return x, mask


def test_modes_match_their_formulas():
    x, m = _batch()
    n = m.sum(-1)
    assert agg_loss(x, m, "token-mean").item() == pytest.approx(((x * m).sum() / m.sum()).item(), rel=1e-12)
    assert agg_loss(x, m, "seq-mean-token-sum").item() == pytest.approx((x * m).sum(-1).mean().item(), rel=1e-12)
    assert agg_loss(x, m, "seq-mean-token-mean").item() == pytest.approx(((x * m).sum(-1) / n).mean().item(), rel=1e-12)
    want = ((x * m).sum(-1) / x.shape[-1]).mean().item()  # Dr.GRPO: constant = max response length T
    assert agg_loss(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(want, rel=1e-12)
    assert agg_loss(x, m, "seq-mean-token-sum-norm", norm_constant=100).item() == pytest.approx(
        ((x * m).sum(-1) / 100).mean().item(), rel=1e-12)


def test_masked_tokens_do_not_matter_and_empty_rows_give_no_nan():
    x, m = _batch()
    y = x.clone()
    y[m == 0] = 1e6
    for mode in LOSS_AGG_MODES:
        assert agg_loss(y, m, mode).item() == pytest.approx(agg_loss(x, m, mode).item(), rel=1e-12)
    m2 = m.clone()
    m2[0] = 0
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(agg_loss(x, m2, mode))
    assert agg_loss(x, torch.zeros_like(m), "token-mean").item() == 0.0


def test_unknown_mode_names_the_key():
    x, m = _batch()
    with pytest.raises(ValueError, match="loss_agg_mode.*token-mean"):
        agg_loss(x, m, "seq-sum")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("n_micro", [1, 2, 5])
def test_micro_batch_sum_equals_full_batch_value_and_gradient(mode, n_micro):
    x, m = _batch(B=10, T=9, seed=3)
    m[4] = 0  # an empty sequence (e.g. DP padding) must not shift the seq denominators
    full_x = x.clone().requires_grad_(True)
    full = agg_loss(full_x, m, mode)
    full.backward()

    tokens, seqs = count_tokens_and_seqs(m)
    parts_x = x.clone().requires_grad_(True)
    total = sum(
        agg_loss(px, pm, mode, global_tokens=tokens, global_seqs=seqs)
        for px, pm in zip(parts_x.chunk(n_micro), m.chunk(n_micro), strict=True)
    )
    total.backward()
    torch.testing.assert_close(total, full, rtol=1e-6, atol=0)
    torch.testing.assert_close(parts_x.grad, full_x.grad, rtol=1e-6, atol=0)


def test_global_counts_are_additive_over_micro_batches():
    _, m = _batch(B=10, T=9, seed=4)
    parts = [count_tokens_and_seqs(pm) for pm in m.chunk(5)]
    assert (sum(p[0] for p in parts), sum(p[1] for p in parts)) == count_tokens_and_seqs(m)


def _pad(t: torch.Tensor, k: int, fill: torch.Tensor | float) -> torch.Tensor:
    """``[B, T]`` -> ``[B, T + k]``: ``fill`` (a ``[B, k]`` tensor or a scalar) in the new columns."""
    extra = fill if isinstance(fill, torch.Tensor) else torch.full((t.shape[0], k), fill, dtype=t.dtype)
    return torch.cat([t, extra], dim=-1)


def test_sum_norm_with_norm_constant_is_independent_of_padding_width():
    """Dr.GRPO's C fixed (rollout.max_response_length): zero-mask columns change nothing, float64 rtol 1e-12."""
    x, m = _batch(B=10, T=7, seed=5)
    C = 32
    g = torch.Generator().manual_seed(6)
    a = x.clone().requires_grad_(True)
    narrow = agg_loss(a, m, "seq-mean-token-sum-norm", norm_constant=C)
    narrow.backward()
    for k in (1, 9, 30):  # T + k never equals C here
        b = x.clone().requires_grad_(True)
        xb = _pad(b, k, 1e3 * torch.randn(10, k, generator=g, dtype=torch.float64))  # garbage under mask 0
        wide = agg_loss(xb, _pad(m, k, 0.0), "seq-mean-token-sum-norm", norm_constant=C)
        wide.backward()
        torch.testing.assert_close(wide, narrow, rtol=1e-12, atol=0)
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=0)
        # Without C the padded width T is used: the value moves with padding (the trainer bug).
        default = agg_loss(xb.detach(), _pad(m, k, 0.0), "seq-mean-token-sum-norm")
        assert default.item() == pytest.approx(narrow.item() * C / (7 + k), rel=1e-12)
        assert default.item() != pytest.approx(narrow.item(), rel=1e-3)


def test_sum_norm_micro_batches_of_different_widths_sum_to_the_full_batch():
    """Micro-batches trimmed to their own longest row (as dynamic batching may pad) + global counts + C."""
    x, m = _batch(B=10, T=9, seed=7)
    C = 16
    full_x = x.clone().requires_grad_(True)
    full = agg_loss(_pad(full_x, C - 9, 0.0), _pad(m, C - 9, 0.0), "seq-mean-token-sum-norm", norm_constant=C)
    full.backward()
    tokens, seqs = count_tokens_and_seqs(m)
    parts_x = x.clone().requires_grad_(True)
    widths, total = [], 0
    for px, pm in zip(parts_x.split([3, 4, 3]), m.split([3, 4, 3]), strict=True):
        w = int(pm.sum(-1).max())
        widths.append(w)
        total = total + agg_loss(px[:, :w], pm[:, :w], "seq-mean-token-sum-norm", global_tokens=tokens,
                                 global_seqs=seqs, norm_constant=C)
    total.backward()
    assert len(set(widths)) > 1, widths  # the micro-batches really have different widths
    torch.testing.assert_close(total, full, rtol=1e-12, atol=0)
    torch.testing.assert_close(parts_x.grad, full_x.grad, rtol=1e-12, atol=0)


def test_non_positive_norm_constant_is_refused():
    x, m = _batch()
    with pytest.raises(ValueError, match="norm_constant.*max_response_length"):
        agg_loss(x, m, "seq-mean-token-sum-norm", norm_constant=0)
