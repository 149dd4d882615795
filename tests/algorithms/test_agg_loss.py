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
