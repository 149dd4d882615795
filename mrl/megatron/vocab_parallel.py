"""Per-token log-probs and entropy from vocab-parallel logits, in bounded memory.

Megatron's vocab-parallel output layer leaves each tensor-parallel (TP) rank ``r`` of ``R`` with
the contiguous vocab shard ``[r*V_l, (r+1)*V_l)`` of the logits, ``V_l = V_pad / R``. This module
computes, without gathering the full vocab, for every token ``n`` (``N`` tokens, flattened from
the leading dims) with ``z = logits / T`` (temperature first — the same ``z`` the rollout engine
samples from, so the trainer's log-probs and the engine's agree; verl ``_forward_micro_batch``):

    lse[n]  = logsumexp_v z[n, v]                      (v < vocab_size: padding is excluded)
    logp[n] = z[n, label[n]] - lse[n]
    H[n]    = lse[n] - sum_v p[n, v] * z[n, v],   p = softmax(z)        (verl entropy_from_logits)

Stable, distributed evaluation (shapes per rank; ``C`` = chunk of tokens):

    m[N]    = allreduce_MAX(max_v z_local)                     one collective for all tokens
    d[C,V_l]= z_local - m                                      (<= 0, so exp never overflows)
    s[N]    = allreduce_SUM(sum_v exp(d))          } stacked into one [N, 3] SUM collective
    dl[N]   = allreduce_SUM(d[label] if local)     }
    sed[N]  = allreduce_SUM(sum_v exp(d) * d)      }
    logp    = dl - log s,   H = log s - sed / s                (m cancels: no large-m cancellation)

Backward needs no communication because ``lse`` is saved: with ``p = exp(z - lse)`` recomputed per
chunk and upstream grads ``g_lp[N]``, ``g_H[N]``,

    dlogp/dz_local = onehot_local(label) - p_local
    dH/dz_local    = -p_local * (z_local - sum_v p z)          (sum over the full vocab, saved)
    dL/dlogits     = (g_lp * dlogp/dz + g_H * dH/dz) / T ;     padded columns get exactly 0.

Memory bound: the function saves only the logits it was given (already alive for the autograd
graph) plus five ``[N]`` vectors. At any time at most two ``[C, V_l]`` buffers in the compute
dtype (fp32, or fp64 for fp64 input) exist, forward and backward, i.e. ``8*C*V_l`` bytes in fp32,
on top of the ``[N, V_l]`` logits gradient in the logits dtype that backward must return anyway.
Example: N=16k tokens, V_l=76k (152k vocab, TP=2): unchunked ~10 GB of fp32 temporaries,
``chunk_size=1024`` ~0.6 GB. Unchunked (``chunk_size=None``) means one chunk of all ``N`` tokens.

Out-of-range labels (``label < 0`` or ``label >= vocab_size``, e.g. an ignore index of ``-100``)
give ``logp = 0`` and no log-prob gradient; entropy is still computed for those tokens. Mask them in
the loss as usual.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["vocab_parallel_log_probs"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 logits are upcast to fp32; fp64 stays fp64 (reference-grade tests).
    return torch.promote_types(dtype, torch.float32)


def _chunks(n: int, chunk_size: int | None) -> list[tuple[int, int]]:
    step = n if chunk_size is None else chunk_size
    return [(i, min(i + step, n)) for i in range(0, n, max(step, 1))]


class _VocabParallelLogProbs(torch.autograd.Function):
    """Autograd wrapper; the math is in the module docstring. Inputs are 2-D: logits [N, V_l],
    labels [N]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        group: Any,
        rank: int,
        world: int,
        temperature: float,
        vocab_size: int,
        chunk_size: int | None,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n, v_local = logits.shape
        cdtype = _compute_dtype(logits.dtype)
        start = rank * v_local
        # Padding sits at the end of the global vocab, so each rank's valid columns are a prefix.
        valid = max(0, min(v_local, vocab_size - start))
        inv_t = 1.0 / temperature

        # Pass 1: global max. max(l/T) == max(l)/T for T > 0, so reduce in the native dtype
        # (exact) with no fp32 [N, V_l] buffer; the same fp32 division is used in pass 2.
        if valid > 0:
            m = logits[:, :valid].amax(dim=-1).to(cdtype)
            if temperature != 1.0:
                m = m * inv_t
        else:
            m = torch.full((n,), float("-inf"), dtype=cdtype, device=logits.device)
        if world > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)

        # Pass 2: per-chunk partial sums, stacked so the whole batch needs one SUM collective.
        sums = torch.zeros((n, 3), dtype=cdtype, device=logits.device)
        local_label = labels - start
        label_here = (local_label >= 0) & (local_label < valid)
        if valid > 0:
            for a, b in _chunks(n, chunk_size):
                d = logits[a:b, :valid].to(cdtype, copy=True)
                if temperature != 1.0:
                    d.mul_(inv_t)
                d.sub_(m[a:b, None])
                idx = local_label[a:b].clamp(0, valid - 1)
                picked = d.gather(1, idx[:, None]).squeeze(1)
                sums[a:b, 1] = torch.where(label_here[a:b], picked, torch.zeros_like(picked))
                if with_entropy:
                    e = d.exp()
                    sums[a:b, 0] = e.sum(dim=-1)
                    # Batched dot product: avoids a third [C, V_l] buffer for e * d.
                    sums[a:b, 2] = torch.bmm(e[:, None, :], d[:, :, None]).view(-1)
                else:
                    sums[a:b, 0] = d.exp_().sum(dim=-1)
                del d
        if world > 1:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)

        log_s = sums[:, 0].log()
        label_ok = (labels >= 0) & (labels < vocab_size)
        logp = torch.where(label_ok, sums[:, 1] - log_s, torch.zeros_like(log_s))
        ed_mean = sums[:, 2] / sums[:, 0]  # sum_v p*(z - m), the entropy's expected shifted logit
        entropy = log_s - ed_mean if with_entropy else torch.empty(0, dtype=cdtype)

        ctx.save_for_backward(logits, labels, m, log_s, ed_mean, label_ok)
        ctx.meta = (rank, temperature, vocab_size, chunk_size, with_entropy)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_h: Tensor | None):  # type: ignore[override]
        logits, labels, m, log_s, ed_mean, label_ok = ctx.saved_tensors
        rank, temperature, vocab_size, chunk_size, with_entropy = ctx.meta
        n, v_local = logits.shape
        cdtype = _compute_dtype(logits.dtype)
        start = rank * v_local
        valid = max(0, min(v_local, vocab_size - start))
        inv_t = 1.0 / temperature
        use_h = with_entropy and g_h is not None
        if g_lp is None and not use_h:
            return (None,) * 9

        grad = torch.zeros_like(logits)  # padded columns keep an exact 0
        if g_lp is not None:
            g_lp = torch.where(label_ok, g_lp.to(cdtype), torch.zeros((), dtype=cdtype))
        else:
            g_lp = torch.zeros((n,), dtype=cdtype, device=logits.device)
        if use_h:
            g_h = g_h.to(cdtype)
        local_label = labels - start
        label_here = (local_label >= 0) & (local_label < valid)
        for a, b in _chunks(n, chunk_size) if valid > 0 else []:
            d = logits[a:b, :valid].to(cdtype, copy=True)
            if temperature != 1.0:
                d.mul_(inv_t)
            d.sub_(m[a:b, None])  # d = z - m
            p = (d - log_s[a:b, None]).exp_()  # softmax over the full vocab
            if use_h:
                # coef = g_lp + g_H * (z - sum p z), in place in d (z - sum p z = d - ed_mean).
                d.sub_(ed_mean[a:b, None]).mul_(g_h[a:b, None]).add_(g_lp[a:b, None])
                p.mul_(d).neg_()  # -p * coef
            else:
                p.mul_(g_lp[a:b, None]).neg_()
            del d
            rows = torch.nonzero(label_here[a:b]).squeeze(1)
            cols = local_label[a:b][rows]
            p[rows, cols] += g_lp[a:b][rows]  # onehot term of dlogp/dz
            if temperature != 1.0:
                p.mul_(inv_t)
            grad[a:b, :valid] = p
            del p
        return grad, None, None, None, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of ``labels`` and (optionally) entropy under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V_l]`` this TP rank's contiguous vocab shard (rank ``r`` of the group holds
            global ids ``[r*V_l, (r+1)*V_l)``); any float dtype, computed in fp32 (fp64 stays fp64).
            Pass a contiguous tensor: a non-contiguous one is copied once when flattened.
        labels: ``[...]`` global token ids (the leading dims of ``logits``).
        tp_group: the tensor-parallel process group (on a Megatron run
            ``parallel_state.get_tensor_model_parallel_group()``); ``None`` = the full vocab is
            on this one rank.
        temperature: ``T > 0``; logits are divided by it first.
        vocab_size: the true, un-padded vocab; global ids ``>= vocab_size`` get no probability mass.
            ``None`` = ``V_l * tp_size`` (no padding).
        chunk_size: tokens per chunk; bounds the fp32 temporaries to ``2 * chunk_size * V_l``
            elements in forward and backward. ``None`` = one chunk.
        with_entropy: also return the entropy.

    Returns:
        ``(log_probs [...], entropy [...] or None)`` in the compute dtype (fp32 for bf16 input),
        differentiable w.r.t. ``logits``; see the module docstring for the math and memory bound.
    """
    if logits.dim() < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"vocab_parallel_log_probs: labels must have the leading shape of logits; got logits "
            f"{tuple(logits.shape)} and labels {tuple(labels.shape)} (logits are [..., V_local])."
        )
    if not logits.is_floating_point():
        raise TypeError(
            f"vocab_parallel_log_probs: logits must be floating point, got {logits.dtype}."
        )
    if not temperature > 0:
        raise ValueError(f"vocab_parallel_log_probs: temperature must be > 0, got {temperature}.")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(
            "vocab_parallel_log_probs: chunk_size must be a positive int or None, "
            f"got {chunk_size!r}."
        )
    if tp_group is None:
        rank, world = 0, 1
    else:
        rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    v_local = logits.shape[-1]
    padded = v_local * world
    if vocab_size is None:
        vocab_size = padded
    if not 0 < vocab_size <= padded:
        raise ValueError(
            f"vocab_parallel_log_probs: vocab_size={vocab_size} must be in [1, {padded}] "
            f"(= V_local {v_local} x tp_size {world}); pass the tokenizer's un-padded vocab size."
        )
    lead = labels.shape
    logp, entropy = _VocabParallelLogProbs.apply(
        logits.reshape(-1, v_local), labels.reshape(-1).long(), tp_group, rank, world,
        float(temperature), int(vocab_size), chunk_size, with_entropy,
    )
    return logp.view(lead), (entropy.view(lead) if with_entropy else None)
