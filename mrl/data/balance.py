"""Sequence-length balanced partitions: DP load balance and dynamic micro-batching.

Two users, one algorithm:

* the driver reorders a step's batch so that every DP rank receives a contiguous slice with a
  similar number of tokens (verl ``RayPPOTrainer._balance_batch``, verl's ray_trainer step; docs/driver.md);
* the workers split a mini-batch into micro-batches bounded by a token budget
  (verl ``rearrange_micro_batches``).

The partitioner is greedy longest-processing-time (LPT): items sorted by length, longest
first, each placed on the currently lightest partition (that still has room when
``equal_size``). LPT is within 4/3 of the optimal makespan (Graham 1969); verl uses
Karmarkar–Karp, which is slightly tighter and much longer. Both are deterministic here: ties
break by index so every rank computes the same answer from the same input.

Pure python/torch; imports no Ray or Megatron (design rule for ``mrl.data``).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch


def get_seqlen_balanced_partitions(
    seqlens: Sequence[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """Split item indices ``0..n-1`` into ``k_partitions`` lists with similar length sums.

    Args:
        seqlens: token count of each item, length n.
        k_partitions: number of partitions k (1 <= k <= n).
        equal_size: every partition gets exactly n / k items (n must be divisible by k); used
            for DP sharding, where every rank must hold the same number of samples.

    Returns:
        k lists of indices, each sorted ascending (so a partition keeps its items' original
        relative order), partitions ordered by their smallest index.
    """
    n = len(seqlens)
    if k_partitions < 1 or k_partitions > n:
        raise ValueError(
            f"cannot split {n} items into {k_partitions} partitions: need 1 <= k <= n "
            "(lower the DP size or the micro-batch count, or give more samples)"
        )
    if equal_size and n % k_partitions != 0:
        raise ValueError(
            f"equal_size partitioning needs the item count ({n}) divisible by the partition "
            f"count ({k_partitions}); make the batch size a multiple of the DP size"
        )
    cap = n // k_partitions if equal_size else n
    order = sorted(range(n), key=lambda i: (-int(seqlens[i]), i))
    # heap of (load, count, partition id): lightest first, then fewest items, then lowest id.
    heap = [(0, 0, p) for p in range(k_partitions)]
    parts: list[list[int]] = [[] for _ in range(k_partitions)]
    full: list[tuple[int, int, int]] = []
    for i in order:
        load, cnt, p = heapq.heappop(heap)
        parts[p].append(i)
        cnt += 1
        entry = (load + int(seqlens[i]), cnt, p)
        if cnt < cap:
            heapq.heappush(heap, entry)
        else:
            full.append(entry)
    if not equal_size:
        # Each partition must be non-empty (the pipeline schedule runs every micro-batch).
        # LPT gives every partition one of the k longest items first, so this holds for k <= n.
        assert all(parts), parts
    out = [sorted(p) for p in parts]
    out.sort(key=lambda p: p[0])
    return out


def balanced_dp_permutation(seqlens: Sequence[int] | torch.Tensor, dp_size: int) -> torch.Tensor:
    """Permutation that makes contiguous DP slices token balanced (verl ``_balance_batch``).

    ``batch.index(perm)`` followed by a contiguous split into ``dp_size`` equal slices gives
    rank r the r-th balanced partition. Apply the same permutation to every per-sample field
    (including the group ids ``uid``) so that groups stay identified; GRPO advantages group by
    uid and do not care where a sample lives.

    Args:
        seqlens: [B] valid tokens per sample (``attention_mask.sum(-1)``).
        dp_size: data-parallel world size D; B must be divisible by D.

    Returns:
        [B] int64 permutation.
    """
    if isinstance(seqlens, torch.Tensor):
        seqlens = seqlens.tolist()
    parts = get_seqlen_balanced_partitions(seqlens, dp_size, equal_size=True)
    return torch.tensor([i for p in parts for i in p], dtype=torch.long)


def partition_imbalance(seqlens: Sequence[int], parts: Sequence[Sequence[int]]) -> dict[str, float]:
    """max/min/mean tokens per partition, for the ``global_seqlen/*`` metrics verl logs."""
    sums = [sum(int(seqlens[i]) for i in p) for p in parts]
    return {"max": float(max(sums)), "min": float(min(sums)), "mean": sum(sums) / len(sums)}
