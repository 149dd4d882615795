"""DP balance and token-budget partitions (verl _balance_batch / rearrange_micro_batches)."""
import itertools

import pytest
import torch

from mrl.data.balance import (
    balanced_dp_permutation,
    get_seqlen_balanced_partitions,
    partition_imbalance,
)


def _best_makespan(lens, k):
    best = None
    for assign in itertools.product(range(k), repeat=len(lens)):
        sums = [0] * k
        for i, p in enumerate(assign):
            sums[p] += lens[i]
        best = max(sums) if best is None else min(best, max(sums))
    return best


def test_partitions_cover_every_index_once_and_equal_size():
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 100, (24,), generator=g).tolist()
    parts = get_seqlen_balanced_partitions(lens, 4, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(24))
    assert all(len(p) == 6 for p in parts)
    assert all(p == sorted(p) for p in parts)
    stats = partition_imbalance(lens, parts)
    # LPT with equal sizes on random data: within 10% of the mean here (contiguous split: worse).
    assert stats["max"] <= 1.10 * stats["mean"]
    contiguous = [list(range(r * 6, r * 6 + 6)) for r in range(4)]
    assert stats["max"] <= partition_imbalance(lens, contiguous)["max"]


def test_lpt_within_four_thirds_of_optimum():
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        lens = torch.randint(1, 50, (8,), generator=g).tolist()
        parts = get_seqlen_balanced_partitions(lens, 3, equal_size=False)
        assert all(parts)
        mk = partition_imbalance(lens, parts)["max"]
        assert mk <= 4 / 3 * _best_makespan(lens, 3) + 1e-9


def test_dp_permutation_moves_group_ids_with_their_samples():
    lens = torch.tensor([60, 50, 40, 30, 9, 7, 3, 1])  # contiguous halves: 180 vs 20 tokens
    uid = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    perm = balanced_dp_permutation(lens, dp_size=2)
    assert sorted(perm.tolist()) == list(range(8))
    new_lens, new_uid = lens[perm], uid[perm]
    # every (length, uid) pair survives the reorder
    assert sorted(zip(new_lens.tolist(), new_uid.tolist())) == sorted(zip(lens.tolist(), uid.tolist()))
    halves = new_lens.view(2, 4).sum(1).tolist()
    assert halves == [100, 100]  # LPT reaches the optimum here: {60,30,9,1} / {50,40,7,3}


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="multiple of the DP size"):
        get_seqlen_balanced_partitions([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        get_seqlen_balanced_partitions([1, 2], 3, equal_size=False)
