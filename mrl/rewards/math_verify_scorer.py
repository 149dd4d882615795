"""``reward.function=math``: the final ``\\boxed{}`` answer, checked for equivalence with ``math-verify``.

The scorer of MATH-style data (verl's ``math_verify`` reward, TRL's ``accuracy_reward``):

1. ``pred`` = the content of the response's LAST ``\\boxed{...}`` (or ``\\fbox{...}``), braces
   balanced; ``\\boxed 5`` (no braces) too. No box, or an answer longer than ``_MAX_ANSWER_CHARS``
   (a degenerate response, not an answer) → score 0, ``pred=None``.
2. The ground truth may be the bare answer (``\\frac{1}{2}``) or a full solution with its own
   ``\\boxed{}``; either way both sides are parsed by ``math_verify.parse`` (LaTeX → sympy) and
   compared by ``math_verify.verify`` (symbolic and numeric equality, sets, intervals, matrices,
   ``\\dfrac``/``\\frac``, units like ``^\\circ``) — not by a hand-written normaliser.
3. score = 1.0 when equivalent, else 0.0. Returned as ``{"score", "acc", "pred"}`` so that
   validation reports ``acc`` and votes ``maj@k`` on ``pred``.

Malformed LaTeX parses to nothing and scores 0; no exception leaves the scorer. Parsing and
comparing each stop after ``timeout_s`` seconds (math-verify's SIGALRM timeout, which exists only on
a process's main thread — where both the scoring pool's workers and ``reward.workers=0`` call
scorers; on another thread the call runs without it, under ``reward.timeout_s`` of the pool only).
"""
from __future__ import annotations

import threading

from mrl.rewards.registry import register_reward

_MAX_ANSWER_CHARS = 1000
_BOX_CMDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` of ``text`` (outer braces removed), or None.

    Linear in ``len(text)``: one backwards search for the command, one forward brace scan.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_CMDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_CMDS if text.startswith(c, start))
    rest = text[start + len(cmd):]
    if rest.startswith(" "):  # "\boxed 5": the answer runs to the next whitespace or '$'
        token = rest[1:].split("$")[0].split()
        return token[0] if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: "\boxed{\frac{3}{" is no answer


def _parse(latex: str, timeout_s: int | None):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(f"$\\boxed{{{latex}}}$", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=timeout_s)


def is_equivalent(pred: str, ground_truth: str, timeout_s: int = 2) -> bool:
    """``math_verify`` equivalence of two LaTeX answers (bare, not boxed); False on anything unparsable."""
    from math_verify import verify

    # SIGALRM can only be armed from the main thread; elsewhere signal.signal would raise.
    t = timeout_s if threading.current_thread() is threading.main_thread() else None
    try:
        gold, answer = _parse(ground_truth, t), _parse(pred, t)
        return bool(gold) and bool(answer) and bool(verify(gold, answer, timeout_seconds=t))
    except Exception:  # noqa: BLE001 - malformed LaTeX that math-verify did not catch itself is a wrong answer
        return False


@register_reward("math")
def math_answer(solution_str: str, ground_truth: str, data_source: str | None = None,
                extra_info: dict | None = None, timeout_s: int = 2) -> dict[str, float | str | None]:
    """1.0 when the last ``\\boxed{}`` of the response is math-equivalent to ``ground_truth``, else 0.0."""
    pred = extract_boxed(str(solution_str))
    if pred is None or not pred.strip() or len(pred) > _MAX_ANSWER_CHARS:
        return {"score": 0.0, "acc": 0.0, "pred": None}
    gt = str(ground_truth)
    gt = extract_boxed(gt) or gt  # a full reference solution: its boxed answer
    ok = is_equivalent(pred, gt, timeout_s)
    return {"score": float(ok), "acc": float(ok), "pred": pred}
