"""The ``math`` (boxed + math-verify) and ``countdown`` (verl's rule) scorers, table-driven."""
import time

import pytest

from mrl.rewards import get_reward_fn
from mrl.rewards.countdown import evaluate_equation, extract_equation
from mrl.rewards.math_verify_scorer import extract_boxed

math_score = get_reward_fn("math")
countdown = get_reward_fn("countdown")


@pytest.mark.parametrize("text,boxed", [
    ("so the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("nested \\boxed{\\{1, \\{2\\}\\}} done", "\\{1, \\{2\\}\\}"),
    ("\\fbox{7}", "7"),
    ("the answer is \\boxed 5$ yes", "5"),
    ("unbalanced \\boxed{\\frac{3}{", None),
    ("\\boxed x", "x"),
    ("no box: 42", None),
    ("\\boxed", None),
])
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize("response,ground_truth,score", [
    # equivalent forms math-verify accepts and a string compare would not
    ("Adding, we get $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("So $x = \\boxed{0.5}$", "\\frac12", 1.0),
    ("Factoring: $\\boxed{x(x+2)}$", "x^2+2x", 1.0),
    ("The interval is $\\boxed{(1, 2)}$", "(1,2)", 1.0),
    ("$\\boxed{\\frac{\\sqrt{2}}{2}}$", "\\sqrt{2}/2", 1.0),
    ("the set is $\\boxed{\\{2,1\\}}$", "\\{1,2\\}", 1.0),
    ("angle $\\boxed{30^\\circ}$", "30", 1.0),
    ("$\\boxed{10}$", "10", 1.0),
    # a full reference solution as ground truth: its own boxed answer counts
    ("$\\boxed{6}$", "We compute $2\\cdot 3 = \\boxed{6}$.", 1.0),
    # wrong answers
    ("$\\boxed{\\frac{1}{3}}$", "\\frac{1}{2}", 0.0),
    ("$\\boxed{(1, 2]}$", "(1,2)", 0.0),
    ("the answer is 10", "10", 0.0),  # no box
    # malformed LaTeX: 0, never an exception
    ("$\\boxed{\\frac{3}{$", "3", 0.0),
    ("$\\boxed{\\frac{}{}}$", "1", 0.0),
    ("$\\boxed{}}$", "1", 0.0),
    ("$\\boxed{\\sqrt[}{2}}$", "1", 0.0),
    ("$\\boxed{\\left( 1 \\right.}$", "1", 1.0),  # math-verify recovers the 1
    ("$\\boxed{\\begin{pmatrix} 1 & 2 \\end{bmatrix}}$", "1", 0.0),
    ("$\\boxed{3}$", "\\frac{", 0.0),  # malformed ground truth scores 0 too
])
def test_math_scores(response, ground_truth, score):
    out = math_score(solution_str=response, ground_truth=ground_truth, data_source="math", extra_info=None)
    assert out["score"] == score and out["acc"] == score
    assert set(out) == {"score", "acc", "pred"}


def test_math_pred_is_the_boxed_answer_for_maj_at_k():
    assert math_score(solution_str="$\\boxed{7}$", ground_truth="7")["pred"] == "7"
    assert math_score(solution_str="no box", ground_truth="7")["pred"] is None


@pytest.mark.parametrize("response", [
    "$\\boxed{10^{10^{10^{10^{10}}}}}$",  # sympy would compute a tower of powers: comparison times out
    "$\\boxed{" + "(" * 900 + "}$",  # parser blow-up: parsing times out
    "$\\boxed{" + "1+" * 5000 + "1}$",  # degenerate length: refused before parsing
])
def test_math_pathological_input_is_bounded(response):
    t = time.monotonic()
    assert math_score(solution_str=response, ground_truth="10", timeout_s=1)["score"] == 0.0
    # parse and verify each have timeout_s=1 (1-2 s on a quiet host). The bound separates "stopped by the
    # timeouts" from "unbounded" (without them these inputs run for minutes or exhaust memory), not fast
    # from slow: SIGALRM only lands between Python bytecodes, so under CI load one case took 6.2 s.
    assert time.monotonic() - t < 30


@pytest.mark.parametrize("response,equation", [
    ("Let me think... <answer>(1 + 2) * 3</answer>", "(1 + 2) * 3"),
    ("Assistant: reasoning\n<answer>4 - 1</answer> and <answer>3 * 1</answer>", "3 * 1"),
    ("<answer>1 + 2</answer>\nthen more text", None),  # verl reads only the last line
    ("no tags 1 + 2", None),
])
def test_countdown_extraction(response, equation):
    assert extract_equation(response) == equation


@pytest.mark.parametrize("equation,value", [
    ("(1 + 2) * 3", 9.0), ("8 / (3 - 1)", 4.0), ("-2 + 5", 3.0),
    ("9**9**9**9", None),  # passes verl's character filter, would hang eval
    ("1 / (2 - 2)", None), ("__import__('os')", None), ("1 +", None), ("2 (3)", None),
])
def test_countdown_safe_evaluation(equation, value):
    assert evaluate_equation(equation) == value


GT = {"target": 24, "numbers": [2, 3, 4]}


@pytest.mark.parametrize("response,ground_truth,score", [
    ("<answer>(2 + 4) * 4</answer>", GT, 0.1),  # 4 used twice, 3 unused
    ("<answer>2 * 3 * 4</answer>", GT, 1.0),
    ("<answer>4 * 3 * 2</answer>", '{"target": 24, "numbers": [2, 3, 4]}', 1.0),  # JSON ground truth
    ("<answer>2 + 3 + 4</answer>", GT, 0.1),  # valid numbers, wrong value
    ("<answer>2 ** 3 * 4</answer>", GT, 0.1),  # power is not a Countdown operation
    ("<answer>2 * 3 * 4 = 24</answer>", GT, 0.1),  # '=' fails the character filter, as in verl
    ("I give up", GT, 0.0),
])
def test_countdown_scores(response, ground_truth, score):
    assert countdown(solution_str=response, ground_truth=ground_truth) == score


def test_countdown_bad_ground_truth_names_the_shape():
    with pytest.raises(ValueError, match="countdown ground_truth must be"):
        countdown(solution_str="<answer>1</answer>", ground_truth={"target": 1})


def test_math_in_a_spawned_scoring_worker_keeps_its_timeout():
    # Pool workers call scorers on their main thread, where math-verify's SIGALRM timeout works.
    from mrl.rewards.pool import ScoringPool

    pool = ScoringPool("math", workers=1, timeout_s=30)
    try:
        out = pool.map([{"solution_str": "$\\boxed{\\dfrac{1}{2}}$", "ground_truth": "0.5"},
                        {"solution_str": "$\\boxed{10^{10^{10^{10^{10}}}}}$", "ground_truth": "10"}])
    finally:
        pool.close()
    assert [o.score for o in out] == [1.0, 0.0] and all(o.error is None for o in out)
