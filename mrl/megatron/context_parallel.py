"""Context parallelism (CP) without Transformer Engine: the zigzag layout of a packed row and its collectives.

A packed row (:func:`mrl.workers.minibatch.build_packed_inputs`) holds whole sequences; with CP each sequence
``i`` is padded (at its end: causal attention never lets a real token see it) to a length ``n_i`` that is a
multiple of ``2·CP`` and cut into ``2·CP`` chunks of ``c_i = n_i / (2·CP)`` columns. CP rank ``r`` holds chunks
``r`` and ``2·CP − 1 − r`` of every sequence (the load-balanced "zigzag" layout of Megatron/Transformer Engine:
under a causal mask chunk ``j`` attends ``(j + 1)·c`` keys, so every rank's pair costs
``(r + 1) + (2·CP − r) = 2·CP + 1`` chunk-key blocks)::

    local row of rank r = [seq_1 chunk r | seq_1 chunk 2CP-1-r | seq_2 chunk r | seq_2 chunk 2CP-1-r | ...]

Attention (:class:`mrl.megatron.sdpa_attention.SDPAAttention`): each rank all-gathers K and V over the CP group
(:func:`gather_kv`, whose backward reduce-scatters dK/dV: every rank's queries read every rank's keys, so the
gradient of rank r's keys is the sum of all ranks' contributions), puts them back in global order and lets each
local query chunk attend the key prefix its global positions may see. RoPE rotates by the global positions
(:mod:`mrl.megatron.rope_positions` reads the local row's ``position_ids``).

After the logits (:meth:`mrl.workers.minibatch.ModelInputs.gather_response`): per-position values (log-probs,
entropies, values) are all-gathered back into the whole row (:func:`gather_same_loss`), so every CP rank computes
the same loss on the whole micro-batch — every loss_agg_mode, token count and sequence count is the CP=1 one.
Since each rank's loss is the same function of the gathered values, the gradient reaching rank r's slice is
the loss's own gradient there: the backward keeps that slice (no sum). Megatron's schedule multiplies the loss
by CP and its DDP averages gradients over DP × CP, so the sum over CP ranks of their partial gradients
(each rank's parameters saw only its tokens) comes out as the CP=1 gradient, averaged over DP as before.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of ``2·cp_size``) of every sequence that CP rank ``cp_rank`` holds, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"CP rank {cp_rank} is not in [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_columns(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """[T / cp_size] int64: the global column of each column of rank ``cp_rank``'s local row.

    ``cu_seqlens`` [k + 1] bounds the (padded) sequences of the whole row; each length must be a multiple of
    ``2·cp_size``."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    bad = [n for n in lens if n % (2 * cp_size)]
    if bad:
        raise ValueError(f"context parallelism: sequence lengths {bad} are not multiples of 2*CP = {2 * cp_size}")
    cols = []
    for start, n in zip(cu_seqlens[:-1].tolist(), lens):
        c = n // (2 * cp_size)
        for j in zigzag_chunks(cp_size, cp_rank):
            cols.append(torch.arange(start + j * c, start + (j + 1) * c))
    return torch.cat(cols) if cols else torch.zeros(0, dtype=torch.long)


def global_order(cu_seqlens: Tensor, cp_size: int) -> Tensor:
    """[T] int64: ``full = gathered.flatten(0, 1)[global_order(...)]`` puts the ranks' stacked local rows
    (``[cp_size, T / cp_size, ...]``, rank-major) back in global column order."""
    cols = torch.cat([local_columns(cu_seqlens, cp_size, r) for r in range(cp_size)])
    return torch.argsort(cols)


def _all_gather(x: Tensor, group: Any) -> Tensor:
    """[n, *x.shape]: every rank's ``x`` stacked in group-rank order."""
    n = dist.get_world_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # the collectives concatenate along dim 0
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.13: the old name
    fn(out, x.contiguous(), group=group)
    return out.view(n, *x.shape)


class _GatherKV(torch.autograd.Function):
    """All-gather forward; reduce-scatter (sum) backward: each rank's queries read every rank's keys."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.new_empty(grad.shape[1:])
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn(out, grad.contiguous().flatten(0, 1), group=ctx.group)
        return out, None


class _GatherSameLoss(torch.autograd.Function):
    """All-gather forward; the backward keeps this rank's slice: every rank computes the same function of the
    gathered tensor, so its gradient there is already the whole gradient (summing would count it CP times)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.rank = dist.get_rank(group)
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad[ctx.rank].contiguous(), None


def gather_kv(x: Tensor, group: Any) -> Tensor:
    """[n, *x.shape] keys/values of every CP rank (dK/dV reduce-scattered back in the backward)."""
    return _GatherKV.apply(x, group)


def gather_same_loss(x: Tensor, group: Any) -> Tensor:
    """[n, *x.shape] per-position values of every CP rank, for a loss every rank computes identically."""
    return _GatherSameLoss.apply(x, group)


def cp_group_and_rank(group: Any = None) -> tuple[Any, int, int]:
    """(group, size, rank) of Megatron's CP group (or ``group``); size 1 when parallel_state is not set up."""
    if group is None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return None, 1, 0
        group = ps.get_context_parallel_group()
    return group, dist.get_world_size(group), dist.get_rank(group)
