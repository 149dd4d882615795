"""RewardManager: in-process and pooled scoring, timeouts, on_error, last-token placement."""
import time

import pytest
import torch

from mrl.config.reward import RewardConfig
from mrl.rewards import RewardManager, place_on_last_token


def test_place_on_last_token_any_mask_layout():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 1]])
    out = place_on_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    exp = torch.zeros(4, 4)
    exp[0, 2], exp[1, 0], exp[3, 3] = 1.0, 2.0, 4.0  # empty response (row 2) gets no score
    assert torch.equal(out, exp)
    with pytest.raises(ValueError, match=r"\[B, T\] with B=4"):
        place_on_last_token(torch.ones(4), torch.ones(3, 2))


def test_in_process_scores_and_token_level_scores():
    m = RewardManager.from_config(RewardConfig(function="arith", workers=0))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    r = m([" 7</s>", " 9"], ["7", "8"], response_mask=mask)
    assert torch.equal(r.scores, torch.tensor([1.0, 0.0]))
    assert torch.equal(r.token_level_scores, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert r.valid.all() and r.errors == [None, None]


def test_in_process_on_error_modes_and_alarm_timeout():
    spec = "tests.rewards._scorers:crashy"
    with pytest.raises(RuntimeError, match=r"sample 1 .*ValueError: bad answer format.*reward.on_error=zero\|mask"):
        RewardManager(spec, on_error="raise")(["ok", "boom"], ["", ""])
    r = RewardManager(spec, on_error="zero")(["ok", "boom"], ["", ""])
    assert r.scores.tolist() == [1.0, 0.0] and r.valid.tolist() == [True, True]
    r = RewardManager(spec, on_error="mask")(["ok", "boom"], ["", ""])
    assert r.scores.tolist() == [1.0, 0.0] and r.valid.tolist() == [True, False]
    assert "ValueError" in r.errors[1]
    t0 = time.monotonic()
    r = RewardManager("tests.rewards._scorers:sleepy", timeout_s=0.3, on_error="mask")(["hang", "ab"], ["", ""])
    assert time.monotonic() - t0 < 60  # the 0.3 s timeout, not the scorer's 3600 s sleep (a loaded host may be slow)
    assert r.valid.tolist() == [False, True] and r.scores.tolist() == [0.0, 2.0] and "TimeoutError" in r.errors[0]


def test_pool_kills_a_hung_scorer_and_keeps_going():
    with RewardManager("tests.rewards._scorers:sleepy", workers=2, timeout_s=1.0, on_error="mask") as m:
        t0 = time.monotonic()
        r = m(["a", "hang", "abc", "hang", "abcd"], [""] * 5, response_mask=torch.ones(5, 2))
        took = time.monotonic() - t0
        assert r.valid.tolist() == [True, False, True, False, True]
        assert r.scores.tolist() == [1.0, 0.0, 3.0, 0.0, 4.0]
        assert "timeout_s=1.0" in r.errors[1]
        assert r.token_level_scores[:, 1].tolist() == [1.0, 0.0, 3.0, 0.0, 4.0]
        assert took < 10.0, took  # two 1 s timeouts + restarts on a loaded host; never the 3600 s sleep
        # Killed workers were replaced: the pool still scores.
        assert m(["xy"], [""]).scores.tolist() == [2.0]
        assert len(m._pool._workers) == 2 and all(w.proc.is_alive() for w in m._pool._workers)
    assert m._pool._workers == []


def test_pool_worker_crash_and_exceptions_follow_on_error():
    with RewardManager("tests.rewards._scorers:crashy", workers=1, timeout_s=5.0, on_error="zero") as m:
        r = m(["ok", "die", "boom", "ok"], [""] * 4)
        assert r.scores.tolist() == [1.0, 0.0, 0.0, 1.0] and r.valid.all()
        assert "exited (code 7)" in r.errors[1] and "bad answer format" in r.errors[2]
    with RewardManager("tests.rewards._scorers:crashy", workers=1, on_error="raise") as m, \
            pytest.raises(RuntimeError, match="sample 0"):
        m(["boom"], [""])


def test_pool_runs_file_scorers_in_other_processes(tmp_path):
    f = tmp_path / "s.py"
    f.write_text("import os\ndef score(solution_str, ground_truth, **kw):\n    return float(os.getpid())\n")
    with RewardManager(f"{f}:score", workers=2, timeout_s=10.0) as m:
        pids = set(m(["a"] * 6, [""] * 6).scores.int().tolist())
    import os
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_error"):
        RewardManager("arith", on_error="ignore")
    with pytest.raises(ValueError, match="unknown reward"):
        RewardManager("nope")
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        RewardManager("arith")(["1", "2"], ["1"])


def test_pool_replaces_a_worker_killed_while_idle():
    with RewardManager("arith", workers=1, timeout_s=10.0) as m:
        assert m([" 1"], ["1"]).scores.tolist() == [1.0]
        w = m._pool._workers[0]
        w.proc.kill()
        w.proc.join(5)
        assert m([" 2", " 3"], ["2", "4"]).scores.tolist() == [1.0, 0.0]
        assert m._pool._workers[0] is not w
