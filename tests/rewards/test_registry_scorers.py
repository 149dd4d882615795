"""Registry resolution (name, module:fn, file.py:fn), its errors, and the built-in scorers."""
import pytest

from mrl.rewards import (
    arith,
    exact_match,
    extract_gsm8k_answer,
    get_reward_fn,
    gsm8k,
    register_reward,
    reward_names,
)


def test_builtin_names_and_module_and_file_specs(tmp_path):
    assert {"gsm8k", "arith", "exact_match"} <= set(reward_names())
    assert get_reward_fn("gsm8k") is gsm8k
    assert get_reward_fn("tests.rewards._scorers:sleepy")("abc", "x") == 3.0
    f = tmp_path / "my_reward.py"
    f.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return 2.0 if solution_str == ground_truth else -1.0\n")
    fn = get_reward_fn(f"{f}:compute_score")
    # Called with keywords, as verl calls compute_score: argument order does not matter.
    assert fn(solution_str="7", ground_truth="7", data_source="d", extra_info=None) == 2.0
    assert get_reward_fn(fn) is fn


def test_errors_name_the_spec_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"unknown reward 'gsm9k'.*reward.function.*valid names: .*arith.*gsm8k"):
        get_reward_fn("gsm9k")
    with pytest.raises(ValueError, match=r"does not exist.*fix: reward.function="):
        get_reward_fn(str(tmp_path / "nope.py") + ":f")
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg_xyz.mod'"):
        get_reward_fn("no_such_pkg_xyz.mod:f")
    f = tmp_path / "r.py"
    f.write_text("def score(**kw):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"has no callable 'scor'; did you mean 'score'\? callables there: score"):
        get_reward_fn(f"{f}:scor")
    g = tmp_path / "broken.py"
    g.write_text("raise RuntimeError('oops')\n")
    with pytest.raises(ValueError, match=r"importing .*broken.py.* failed.*oops"):
        get_reward_fn(f"{g}:f")


def test_duplicate_names_refused():
    with pytest.raises(ValueError, match="already registered by mrl.rewards.scorers.gsm8k"):
        register_reward("gsm8k")(lambda **kw: 0.0)
    with pytest.raises(ValueError, match="without ':'"):
        register_reward("a:b")


@pytest.mark.parametrize("text,strict,flexible", [
    ("so 3 + 4 = 7\n#### 7", "7", "7"),
    ("#### 1,234 apples", "1234", "1,234"),
    ("first #### 5 then #### -6", "-6", "-6"),
    ("the answer is 42.", None, "42."),
    ("no digits here", None, None),
    ("ends with a dot 12 .", None, "12"),
])
def test_gsm8k_extraction_matches_verl_rules(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_gsm8k_and_arith_scores():
    assert gsm8k("blah #### 72", "72") == 1.0
    assert gsm8k("blah #### 71", "72") == 0.0
    assert gsm8k("blah 72", "72") == 0.0  # strict: no ####
    assert gsm8k("blah 72", "72", method="flexible") == 1.0
    # Only the last 300 characters are searched (bounded regex time).
    assert gsm8k("#### 72" + " x" * 200, "72") == 0.0
    assert arith(" 7</s>", "7") == 1.0 and arith(" 7 and 8", 7) == 1.0
    assert arith(" -3", "-3") == 1.0 and arith(" 17", "7") == 0.0 and arith(" seven", "7") == 0.0
    assert exact_match(" yes ", "yes") == 1.0 and exact_match("no", "yes") == 0.0
