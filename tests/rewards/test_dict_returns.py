"""Scorers that return a dict (verl's reward_extra_info): the contract, in process and through the
pool, and the errors that always raise whatever reward.on_error says."""
from pathlib import Path

import numpy as np
import pytest
import torch

from mrl.rewards import RewardManager, RewardResult, ScoreContractError, parse_return

SPEC = "tests.rewards._scorers:dict_score"


def test_parse_return_numbers_and_dicts():
    assert parse_return(1) == (1.0, {}) and parse_return(True) == (1.0, {}) and parse_return(-0.5) == (-0.5, {})
    assert parse_return(np.float32(0.25)) == (0.25, {}) and parse_return(np.bool_(True)) == (1.0, {})
    assert parse_return(torch.tensor(2.0)) == (2.0, {}) and parse_return(np.array([3])) == (3.0, {})
    score, extra = parse_return({"score": 1, "acc": np.bool_(False), "pred": "42", "n": torch.tensor(7)})
    assert score == 1.0 and extra == {"score": 1.0, "acc": 0.0, "pred": "42", "n": 7.0}
    assert all(type(v) is float for k, v in extra.items() if k != "pred")
    assert parse_return({"score": 0.0, "pred": None}) == (0.0, {"score": 0.0, "pred": None})


@pytest.mark.parametrize("value, match", [
    ({"acc": 1.0}, r"dict without 'score' \(keys \['acc'\]\)"),
    ({"score": float("nan")}, r"'score'=float nan: every key except 'pred' must be a finite number"),
    (float("inf"), r"non-finite score inf"),
    ({"score": 1.0, "why": "too long"}, r"'why'=str 'too long'"),
    ({"score": 1.0, "acc": None}, r"'acc'=NoneType None"),
    ({"score": 1.0, "acc": float("-inf")}, r"'acc'=float -inf"),
    ({"score": 1.0, "pred": 42}, r"'pred' must be a str or None .* got int 42; return str\(pred\)"),
    ({"score": 1.0, "reward": 1.0}, r"key 'reward', which validation uses"),
    ({"score": 1.0, 3: 1.0}, r"non-string key 3"),
    ("1.0", r"returned str '1.0'"),
    ((1.0, "A"), r"returned tuple"),
    (torch.tensor([1.0, 2.0]), r"returned Tensor"),
    (None, r"returned NoneType"),
])
def test_parse_return_refuses_with_the_fix(value, match):
    with pytest.raises(ScoreContractError, match=match) as ei:
        parse_return(value)
    assert "fix: return a finite number, or a dict" in str(ei.value) or "return str(pred)" in str(ei.value)


def _check_dict_result(r: RewardResult) -> None:
    assert r.scores.tolist() == [1.0, -1.0, 1.0] and r.valid.all() and r.errors == [None] * 3
    assert r.extra == {"score": [1.0, -1.0, 1.0], "acc": [1.0, 0.0, 1.0], "pred": ["7", "8", "9"],
                       "length": [2.0, 2.0, 2.0]}
    assert r.token_level_scores.tolist() == [[0.0, 1.0], [-1.0, 0.0], [0.0, 1.0]]


def test_dict_returns_in_process_and_through_the_pool():
    args = ([" 7", " 8", " 9"], ["7", "9", "9"])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    _check_dict_result(RewardManager(SPEC)(*args, response_mask=mask))
    with RewardManager(SPEC, workers=2, timeout_s=30.0) as m:
        _check_dict_result(m(*args, response_mask=mask))
    # plain numbers keep an empty extra
    assert RewardManager("arith")([" 1"], ["1"]).extra == {}


@pytest.mark.parametrize("workers", [0, 1])
def test_contract_errors_name_function_row_and_fix_whatever_on_error(workers):
    infos = [{"index": 10}, {"index": 11}]
    with RewardManager(SPEC, workers=workers, timeout_s=30.0, on_error="zero") as m:
        with pytest.raises(ScoreContractError, match=(
                r"reward function 'tests.rewards._scorers:dict_score' on sample 1 \(data_source='toy', "
                r"extra_info.index=11\) returned a dict without 'score'.*fix:")):
            m([" 1", "nokey"], ["1", "1"], data_sources=["toy", "toy"], extra_infos=infos)
        # a NaN score is a failure of that sample (issue 19), counted and zeroed under on_error=zero
        r = m(["nan", " 1"], ["1", "1"])
        assert r.errors[0].startswith("BadScore: returned a non-finite score nan") and r.scores[0] == 0
        assert r.fault_metrics() == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/zeroed_samples": 1.0}
        with pytest.raises(ScoreContractError, match=r"on sample 0 .* 'length'=list \[1, 2\]"):
            m(["list"], ["1"])
        # key sets must agree between the samples of a call (verl needs one value per sample per key)
        with pytest.raises(ScoreContractError, match=(
                r"on sample 2 .* returned keys \['acc', 'score'\] but sample 0 returned "
                r"\['acc', 'length', 'pred', 'score'\]; fix: return the same dict keys for every sample")):
            m([" 1", " 2", "fewer"], ["1", "1", "1"])
        with pytest.raises(ScoreContractError, match=r"on sample 1 .* returned keys \(a plain number\) but sample 0"):
            m([" 1", "plain"], ["1", "1"])
        # the pool/manager still works after refusing
        assert m([" 3"], ["3"]).extra["pred"] == ["3"]


def test_failed_calls_fill_extra_and_raise_names_the_row():
    r = RewardManager(SPEC, on_error="mask")(["boom", " 2", "boom"], ["2", "2", "2"])
    assert r.valid.tolist() == [False, True, False] and r.scores.tolist() == [0.0, 1.0, 0.0]
    assert r.extra == {"score": [0.0, 1.0, 0.0], "acc": [0.0, 1.0, 0.0], "pred": [None, "2", None],
                       "length": [0.0, 2.0, 0.0]}
    # a failure before the first success does not decide the key set; all failed -> no keys known
    assert RewardManager(SPEC, on_error="zero")(["boom"], ["2"]).extra == {}
    with pytest.raises(RuntimeError, match=r"'tests.rewards._scorers:dict_score' on sample 0 \(data_source='d', "
                                           r"extra_info.index=4\) failed .*ValueError: bad answer format"):
        RewardManager(SPEC)(["boom"], ["2"], data_sources=["d"], extra_infos=[{"index": 4}])


def test_callable_scorer_is_named_in_errors():
    def my_scorer(solution_str, ground_truth, **kw):
        return {"acc": 1.0}

    with pytest.raises(ScoreContractError, match=r"reward function '[\w.]*test_dict_returns:.*<locals>.my_scorer' on sample 0"):
        RewardManager(my_scorer)(["x"], ["y"])


def test_cat_joins_chunks_and_checks_keys():
    m = RewardManager(SPEC, on_error="mask")
    a, failed, b = m([" 1", " 2"], ["1", "1"]), m(["boom"], ["1"]), m([" 3"], ["3"])
    r = RewardResult.cat([a, failed, b])
    assert r.scores.tolist() == [1.0, -1.0, 0.0, 1.0] and r.valid.tolist() == [True, True, False, True]
    assert r.extra["pred"] == ["1", "2", None, "3"] and r.extra["acc"] == [1.0, 0.0, 0.0, 1.0]
    assert r.token_level_scores is None and r.errors[2].startswith("ValueError")
    assert all(len(v) == 4 for v in r.extra.values())
    plain = RewardManager("arith")([" 1"], ["1"])
    with pytest.raises(ScoreContractError, match=r"differ between batches: .* vs \(a plain number\)"):
        RewardResult.cat([a, plain])
    assert RewardResult.cat([plain, plain]).extra == {}
    assert RewardResult.cat([failed, b]).extra["score"] == [0.0, 1.0]


def test_the_docs_example_scorer(tmp_path):
    doc = (Path(__file__).parents[2] / "docs" / "rewards.md").read_text()
    code = doc.split("```python\n# my_rewards.py")[1].split("```")[0]
    (tmp_path / "my_rewards.py").write_text("# my_rewards.py" + code)
    r = RewardManager(f"{tmp_path}/my_rewards.py:compute_score")(["so \\boxed{42}", "no box", "\\boxed{41}"], ["42"] * 3)
    assert r.scores.tolist() == [1.0, -1.0, -1.0]
    assert r.extra == {"score": [1.0, -1.0, -1.0], "acc": [1.0, 0.0, 0.0], "formatted": [1.0, 0.0, 1.0],
                       "pred": ["42", None, "41"]}
