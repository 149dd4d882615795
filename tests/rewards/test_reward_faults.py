"""Reward faults are visible and per-sample (issue 19): counted as reward/errors, reward/timeouts,
reward/zeroed_samples with a warning quoting the first error under every policy; NaN, non-numbers
and absurd magnitudes fail only their sample (naming it) instead of stopping the run or silently
zeroing a group's advantages."""
from __future__ import annotations

import logging
import re
import time

import pytest

from mrl.rewards import RewardManager


def scorer(solution_str, ground_truth, **kw):
    return {"nan": float("nan"), "inf": float("inf"), "str": "1.0", "none": None, "huge": 1e39, "big": 1e38,
            "ok": 1.0, "neg": -3.0}[solution_str]


def slow_or_raise(solution_str, ground_truth, **kw):
    if solution_str == "slow":
        time.sleep(5)
    if solution_str == "raise":
        raise ValueError("cannot parse the answer")
    return 1.0


@pytest.mark.parametrize("bad, what", [("nan", "non-finite score nan"), ("inf", "non-finite score inf"),
                                       ("str", "str '1.0' (not a number)"), ("none", "NoneType None (not a number)"),
                                       ("huge", "1e+39, beyond"), ("big", "1e+38, beyond")])
def test_bad_values_fail_only_their_sample(bad: str, what: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="mrl.rewards"):
        r = RewardManager(scorer, on_error="mask")(["ok", bad, "neg"], ["1"] * 3)
    assert r.scores.tolist() == [1.0, 0.0, -3.0] and r.valid.tolist() == [True, False, True]
    assert what in r.errors[1]
    assert r.fault_metrics() == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/zeroed_samples": 0.0}
    assert "1 of 3 reward calls failed" in caplog.text and "on sample 1" in caplog.text and what in caplog.text
    with pytest.raises(RuntimeError, match=f"on sample 1 .*{re.escape(what)}"):
        RewardManager(scorer, on_error="raise")(["ok", bad], ["1"] * 2)


def test_zero_policy_counts_errors_timeouts_and_zeroed(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="mrl.rewards"), \
            RewardManager(slow_or_raise, workers=1, timeout_s=1.0, on_error="zero") as m:
        r = m(["a", "raise", "slow", "b"], ["1"] * 4)
    assert r.scores.tolist() == [1.0, 0.0, 0.0, 1.0] and r.valid.all()
    assert r.fault_metrics() == {"reward/errors": 2.0, "reward/timeouts": 1.0, "reward/zeroed_samples": 2.0}
    assert "2 of 4 reward calls failed (reward.on_error=zero: score 0)" in caplog.text
    assert "ValueError: cannot parse the answer" in caplog.text


def test_clean_batches_report_zero_faults() -> None:
    r = RewardManager(scorer)(["ok"], ["1"])
    assert r.fault_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/zeroed_samples": 0.0}
