"""Batched sampling for the running set: temperature, top-k, top-p, per-request seeds.

For row b with logits z_b [V], temperature T_b, the returned log-prob of the sampled token y_b is

    logprob_b = log_softmax(z_b / T_b)[y_b]          (T_b > 0)
    logprob_b = log_softmax(z_b)[y_b]                (T_b = 0, greedy: y_b = argmax z_b)

over the *full* vocabulary, i.e. before top-k/top-p truncation: the same quantity the trainer's
``compute_log_prob`` computes from the actor's logits divided by the rollout temperature
(verl semantics). Truncation only restricts which tokens can be drawn:
top-k keeps the k largest z_b, top-p keeps the smallest prefix of the sorted distribution whose
mass reaches p (the token that crosses p is kept, as SGLang/HF do), min-p keeps the tokens whose
probability is at least min_p times the largest one's.
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
    min_p: float = 0.0


def sample(logits: torch.Tensor, rows: list[RowSampling], default_gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (any float dtype) -> (tokens [B] int64, logprobs [B] float32).

    Draws by inverse CDF: one uniform u_b per row (from the row's own generator when seeded) and
    token = first index whose cumulative (unnormalised) probability exceeds u_b * total. With
    top-k on every sampled row only the top max(k) candidates are sorted (``topk``), not V.
    Nothing of size [B, V] is written beyond the temperature scaling: the log-probs are
    ``z_y / T - logsumexp(z / T)`` (per-step cost is a visible share of a CPU decode step)."""
    logits = logits.float()
    B = logits.shape[0]
    dev = logits.device
    temps = [r.temperature for r in rows]
    greedy_rows = [i for i, t in enumerate(temps) if t == 0]
    if all(t in (0.0, 1.0) for t in temps):
        scaled = logits  # greedy rows keep T=1 for the returned log-prob (nothing else is defined for T=0)
    else:
        t = torch.tensor([t if t > 0 else 1.0 for t in temps], dtype=torch.float32, device=dev)
        scaled = logits / t[:, None]
    lse = torch.logsumexp(scaled, dim=-1)  # [B]
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    if greedy_rows:
        g = torch.tensor(greedy_rows, device=dev)
        tokens[g] = torch.argmax(logits.index_select(0, g), dim=-1)

    sampled_rows = [i for i in range(B) if temps[i] != 0]
    if sampled_rows:
        every = len(sampled_rows) == B
        idx = None if every else torch.tensor(sampled_rows, device=dev)
        sub = rows if every else [rows[i] for i in sampled_rows]
        cand_lp, cand_idx = _candidates(scaled if every else scaled.index_select(0, idx),
                                        lse if every else lse.index_select(0, idx), sub)
        cdf = torch.cumsum(torch.exp(cand_lp), dim=-1)
        unseeded = [j for j, r in enumerate(sub) if r.generator is None]
        if len(unseeded) == len(sub):
            u = torch.rand(len(sub), generator=default_gen).to(dev)
        else:
            # A request's own generator draws only for that request: its samples do not depend on
            # which other requests share the batch. One draw per row, joined by one cat (a scalar
            # write per row cost more; docs/performance.md, 'Seeded draws joined by one cat').
            seeded = [j for j, r in enumerate(sub) if r.generator is not None]
            drawn_u = torch.cat([torch.rand(1, generator=sub[j].generator) for j in seeded]).to(dev)
            if not unseeded:
                u = drawn_u
            else:
                u = torch.empty(len(sub), dtype=torch.float32, device=dev)
                u[torch.tensor(seeded, device=dev)] = drawn_u
                u[torch.tensor(unseeded, device=dev)] = torch.rand(len(unseeded), generator=default_gen).to(dev)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[1] - 1)
        drawn = pick.squeeze(1) if cand_idx is None else cand_idx.gather(1, pick).squeeze(1)
        if every:
            tokens = drawn
        else:
            tokens[idx] = drawn
    chosen = scaled.gather(1, tokens[:, None]).squeeze(1) - lse
    return tokens, chosen


def _candidates(scaled: torch.Tensor, lse: torch.Tensor,
                rows: list[RowSampling]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (``scaled - lse``) of each row's drawable tokens, -inf outside its top-k / top-p
    set, and their vocabulary ids ([N, K] each; ids None means the columns are the vocabulary)."""
    V = scaled.shape[1]
    dev = scaled.device
    ks = [r.top_k if 0 < r.top_k < V else V for r in rows]
    if max(ks) == V and all(r.top_p >= 1.0 and r.min_p <= 0.0 for r in rows):
        return scaled - lse[:, None], None
    K = max(ks)
    # Log-probs are a per-row shift of the scaled logits: select on the logits, shift K columns.
    if K < V:
        cand, cand_idx = torch.topk(scaled, K, dim=-1, sorted=True)
    else:
        cand, cand_idx = torch.sort(scaled, dim=-1, descending=True)
    cand_lp = cand - lse[:, None]
    ranks = torch.arange(K, device=dev)[None, :]
    drop = ranks >= torch.tensor(ks, device=dev)[:, None]
    ps = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=dev)
    probs = torch.exp(cand_lp)
    # Mass strictly before each token (of the full distribution): kept while it is < p, so the
    # token that crosses p is kept.
    drop |= (torch.cumsum(probs, dim=-1) - probs) >= ps[:, None]
    min_ps = [r.min_p for r in rows]
    if any(m > 0 for m in min_ps):
        # Column 0 is each row's most likely token, so it is never dropped.
        drop |= probs < torch.tensor(min_ps, dtype=torch.float32, device=dev)[:, None] * probs[:, :1]
    return cand_lp.masked_fill(drop, float("-inf")), cand_idx


def top_logprobs(logits: torch.Tensor, temperatures: list[float], num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num`` largest log-probs of each row and their token ids ([N, num] each), for the
    same distribution whose log-prob :func:`sample` returns: ``log_softmax(z / T)`` over the full
    vocabulary (T = 0 meaning 1)."""
    t = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32, device=logits.device)
    scaled = logits.float() / t[:, None]
    lp = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)
    return torch.topk(lp, min(num, lp.shape[-1]), dim=-1)
