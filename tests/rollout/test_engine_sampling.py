"""Sampling: draws follow softmax(z/T) restricted to top-k/top-p; returned log-probs are the
full-vocabulary log_softmax(z/T) of the drawn token; seeded rows are reproducible."""
from __future__ import annotations

import torch

from mrl.rollout.engine.sampling import RowSampling, sample

Z = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))  # probabilities at T = 1


def _draw(n: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [RowSampling(kw.get("temperature", 1.0), kw.get("top_p", 1.0), kw.get("top_k", -1), None)] * n
    return sample(Z.expand(n, -1).clone(), rows, torch.Generator().manual_seed(0))


def test_full_vocab_frequencies_and_logprobs():
    tok, lp = _draw(20000)
    freq = torch.bincount(tok, minlength=5).float() / 20000
    # 4 sigma of a binomial with n=20000, p<=0.5 is < 0.015.
    assert torch.allclose(freq, Z.exp(), atol=0.015), freq
    assert torch.allclose(lp, Z[tok], atol=1e-6)


def test_temperature_changes_distribution_and_logprob():
    tok, lp = _draw(20000, temperature=0.5)
    target = torch.softmax(Z / 0.5, dim=-1)
    freq = torch.bincount(tok, minlength=5).float() / 20000
    assert torch.allclose(freq, target, atol=0.015), freq
    assert torch.allclose(lp, torch.log_softmax(Z / 0.5, -1)[tok], atol=1e-6)


def test_top_k_and_top_p_restrict_support_but_not_logprob():
    tok, lp = _draw(4000, top_k=2)
    assert set(tok.tolist()) == {0, 1}
    assert torch.allclose(lp, Z[tok], atol=1e-6)  # full-vocabulary log-prob, not renormalised
    freq = (tok == 0).float().mean()
    assert abs(freq - 0.5 / 0.7) < 0.03
    tok, _ = _draw(4000, top_p=0.6)  # mass before token 1 is 0.5 < 0.6, before token 2 is 0.7
    assert set(tok.tolist()) == {0, 1}
    tok, _ = _draw(500, top_p=0.5)
    assert set(tok.tolist()) == {0}


def test_greedy_and_seeded_rows():
    rows = [RowSampling(0.0, 1.0, -1, None), RowSampling(1.0, 1.0, -1, torch.Generator().manual_seed(3))]
    logits = Z.expand(2, -1).clone()
    a = [sample(logits, rows, torch.Generator().manual_seed(s))[0][1].item() for s in range(5)]
    rows[1] = RowSampling(1.0, 1.0, -1, torch.Generator().manual_seed(3))
    b = [sample(logits, rows, torch.Generator().manual_seed(100 + s))[0][1].item() for s in range(5)]
    assert a == b  # the seeded row ignores the shared generator
    tok, lp = sample(logits, rows, torch.Generator())
    assert tok[0].item() == 0 and abs(lp[0].item() - Z[0].item()) < 1e-6


def test_min_p_restricts_support_but_not_logprob():
    rows = [RowSampling(1.0, 1.0, -1, None, 0.3)] * 4000  # keeps p >= 0.3 * 0.5: tokens 0, 1
    tok, lp = sample(Z.expand(4000, -1).clone(), rows, torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {0, 1}
    assert torch.allclose(lp, Z[tok], atol=1e-6)
    assert abs((tok == 0).float().mean() - 0.5 / 0.7) < 0.03
    rows = [RowSampling(1.0, 1.0, -1, None, 1.0)] * 100  # only the most likely token
    assert set(sample(Z.expand(100, -1).clone(), rows, torch.Generator().manual_seed(0))[0].tolist()) == {0}


def test_top_logprobs_match_the_sampled_distribution():
    from mrl.rollout.engine.sampling import top_logprobs

    vals, ids = top_logprobs(Z.expand(2, -1).clone(), [0.0, 0.5], 2)
    assert ids.tolist() == [[0, 1], [0, 1]]
    assert torch.allclose(vals[0], Z[:2], atol=1e-6)
    assert torch.allclose(vals[1], torch.log_softmax(Z / 0.5, -1)[:2], atol=1e-6)
