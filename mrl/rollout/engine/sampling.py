"""Batched sampling for the running set: temperature, top-k, top-p, per-request seeds.

For row b with logits z_b [V], temperature T_b, the returned log-prob of the sampled token y_b is

    logprob_b = log_softmax(z_b / T_b)[y_b]          (T_b > 0)
    logprob_b = log_softmax(z_b)[y_b]                (T_b = 0, greedy: y_b = argmax z_b)

over the *full* vocabulary, i.e. before top-k/top-p truncation: the same quantity the trainer's
``compute_log_prob`` computes from the actor's logits divided by the rollout temperature
(verl semantics, seed 001). Truncation only restricts which tokens can be drawn:
top-k keeps the k largest z_b, top-p keeps the smallest prefix of the sorted distribution whose
mass reaches p (the token that crosses p is kept, as SGLang/HF do).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """Sampling settings of one running sequence."""

    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None


def sample(logits: torch.Tensor, rows: list[RowSampling], default_gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> (tokens [B] int64, logprobs [B] float32).

    Draws by inverse CDF: one uniform u_b per row (from the row's own generator when seeded) and
    token = first index whose cumulative (unnormalised) probability exceeds u_b * total. With
    top-k on every sampled row only the top max(k) candidates are sorted (``topk``), not V."""
    logits = logits.float()
    B = logits.shape[0]
    dev = logits.device
    temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=dev)
    greedy = temps == 0
    # Greedy rows keep T=1 for the returned log-prob (nothing else is defined for T=0).
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logprobs_full = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(logits, dim=-1)

    sampled_rows = [i for i in range(B) if not greedy[i]]
    if sampled_rows:
        idx = torch.tensor(sampled_rows, device=dev)
        lp = logprobs_full.index_select(0, idx)
        sub = [rows[i] for i in sampled_rows]
        cand_lp, cand_idx = _candidates(lp, sub)
        cdf = torch.cumsum(torch.exp(cand_lp), dim=-1)
        u = torch.empty(len(sub), dtype=torch.float32, device=dev)
        unseeded = [j for j, r in enumerate(sub) if r.generator is None]
        if unseeded:
            u[torch.tensor(unseeded, device=dev)] = torch.rand(len(unseeded), generator=default_gen).to(dev)
        for j, r in enumerate(sub):
            if r.generator is not None:
                # A request's own generator draws only for that request: its samples do not
                # depend on which other requests share the batch.
                u[j] = float(torch.rand(1, generator=r.generator))
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
        drawn = pick.squeeze(1) if cand_idx is None else cand_idx.gather(1, pick).squeeze(1)
        tokens[idx] = drawn
    chosen = logprobs_full.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen


def _candidates(logprobs: torch.Tensor, rows: list[RowSampling]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of each row's drawable tokens, -inf outside its top-k / top-p set, and their
    vocabulary ids ([N, K] each; ids None means the columns are the vocabulary itself)."""
    V = logprobs.shape[1]
    ks = [r.top_k if 0 < r.top_k < V else V for r in rows]
    if max(ks) == V and all(r.top_p >= 1.0 for r in rows):
        return logprobs, None
    K = max(ks)
    if K < V:
        cand_lp, cand_idx = torch.topk(logprobs, K, dim=-1, sorted=True)
    else:
        cand_lp, cand_idx = torch.sort(logprobs, dim=-1, descending=True)
    ranks = torch.arange(K, device=logprobs.device)[None, :]
    drop = ranks >= torch.tensor(ks, device=logprobs.device)[:, None]
    ps = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=logprobs.device)
    probs = torch.exp(cand_lp)
    # Mass strictly before each token (of the full distribution): kept while it is < p, so the
    # token that crosses p is kept.
    drop |= (torch.cumsum(probs, dim=-1) - probs) >= ps[:, None]
    return cand_lp.masked_fill(drop, float("-inf")), cand_idx
