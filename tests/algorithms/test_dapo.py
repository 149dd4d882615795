"""DAPO: dynamic sampling's group filter and the overlong penalty, against hand-computed values."""
from __future__ import annotations

import pytest
import torch

from mrl.algorithms.dapo import informative_groups, overlong_penalty


def test_groups_with_equal_scores_are_dropped_singletons_kept() -> None:
    # uid 7: all 1 (drop), uid 3: mixed (keep), uid 9: all 0 (drop), uid 5: a single sample (keep)
    uid = torch.tensor([7, 7, 3, 3, 3, 9, 9, 5, 3])
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    keep = informative_groups(metric, uid)
    assert keep.tolist() == [False, False, True, True, True, False, False, True, True]


def test_tiny_differences_count_as_variation() -> None:
    # a partial-credit scorer: 0.5 vs 0.5000001 is a (small) advantage signal, kept as verl's std > 0
    keep = informative_groups(torch.tensor([0.5, 0.5000001, 0.25, 0.25]), torch.tensor([1, 1, 2, 2]))
    assert keep.tolist() == [True, True, False, False]


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match=r"must both be \[B\]"):
        informative_groups(torch.zeros(3), torch.zeros(4, dtype=torch.long))


def test_overlong_penalty_is_zero_then_linear() -> None:
    # L_max 20, buffer 8: free up to 12 tokens, then -factor/8 per token down to -factor at 20
    lengths = torch.tensor([1, 12, 13, 16, 20])
    got = overlong_penalty(lengths, 20, 8, 1.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.125, -0.5, -1.0]), rtol=0, atol=1e-7)
    torch.testing.assert_close(overlong_penalty(lengths, 20, 8, 0.5), got * 0.5, rtol=0, atol=1e-7)


@pytest.mark.parametrize("buf", [0, 20, 25])
def test_overlong_buffer_must_fit(buf: int) -> None:
    with pytest.raises(ValueError, match="overlong buffer length"):
        overlong_penalty(torch.tensor([3]), 20, buf, 1.0)
