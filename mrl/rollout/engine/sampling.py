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
    """logits [B, V] (any float dtype) -> (tokens [B] int64, logprobs [B] float32)."""
    logits = logits.float()
    B, V = logits.shape
    temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=logits.device)
    greedy = temps == 0
    # Greedy rows keep T=1 for the returned log-prob (nothing else is defined for T=0).
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logprobs_full = torch.log_softmax(scaled, dim=-1)
    tokens = torch.argmax(logits, dim=-1)

    sampled_rows = [i for i in range(B) if not greedy[i]]
    if sampled_rows:
        idx = torch.tensor(sampled_rows, device=logits.device)
        lp = logprobs_full.index_select(0, idx)
        sub = [rows[i] for i in sampled_rows]
        if any(r.top_k > 0 and r.top_k < V for r in sub) or any(r.top_p < 1.0 for r in sub):
            lp = _truncate(lp, sub)
        probs = torch.exp(lp)
        drawn = torch.empty(len(sampled_rows), dtype=torch.long, device=logits.device)
        unseeded = [j for j, r in enumerate(sub) if r.generator is None]
        if unseeded:
            u = torch.tensor(unseeded, device=logits.device)
            drawn[u] = torch.multinomial(probs.index_select(0, u), 1, generator=default_gen).squeeze(1)
        for j, r in enumerate(sub):
            if r.generator is not None:
                # A request's own generator draws only for that request: its samples do not
                # depend on which other requests share the batch.
                drawn[j] = torch.multinomial(probs[j], 1, generator=r.generator)[0]
        tokens[idx] = drawn
    chosen = logprobs_full.gather(1, tokens[:, None]).squeeze(1)
    return tokens, chosen


def _truncate(logprobs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Set log-probs outside each row's top-k / top-p set to -inf. logprobs [N, V]."""
    N, V = logprobs.shape
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    ranks = torch.arange(V, device=logprobs.device)[None, :].expand(N, V)
    ks = torch.tensor([r.top_k if 0 < r.top_k < V else V for r in rows], device=logprobs.device)
    ps = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=logprobs.device)
    drop = ranks >= ks[:, None]
    probs_sorted = torch.exp(sorted_lp)
    # mass strictly before each token: a token is kept while the mass before it is < p.
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    drop |= mass_before >= ps[:, None]
    sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
    out = torch.full_like(logprobs, float("-inf"))
    return out.scatter(1, order, sorted_lp)
