"""``reward.function=countdown``: verl's Countdown rule (``verl.utils.reward_score.countdown``).

The task: reach ``target`` using each of ``numbers`` exactly once with ``+ - * /`` and brackets.
The ground truth is ``{"target": int, "numbers": [int, ...]}`` (a dict, or its JSON string). The
response's answer is the last ``<answer>...</answer>`` of its last line (after ``Assistant:`` /
``<|im_start|>assistant`` when the response still carries that marker), as in verl:

* no answer → 0.0
* answer uses other numbers than ``numbers`` (each exactly once), has characters other than
  digits, ``+-*/()``, ``.`` and spaces, does not evaluate, or misses the target → ``format_score`` (0.1)
* evaluates to ``target`` (within 1e-5) → ``score`` (1.0)

Unlike verl, the equation is evaluated by walking its ``ast`` (numbers, ``+ - * /``, unary ``-``),
never ``eval``: ``9**9**9**9`` (``**`` passes verl's character filter) is refused instead of hanging.
"""
from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

from mrl.rewards.registry import register_reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>")
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_MARKERS = ("Assistant:", "<|im_start|>assistant")
_MAX_EQ_CHARS = 200  # a Countdown equation is a few numbers long
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def extract_equation(solution_str: str) -> str | None:
    """The last ``<answer>`` of the response's last line, stripped, or None."""
    for marker in _MARKERS:
        if marker in solution_str:
            solution_str = solution_str.split(marker, 1)[1]
            break
    found = _ANSWER.findall(solution_str.split("\n")[-1])
    return found[-1].strip() if found else None


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError(f"{type(node).__name__} is not allowed in a Countdown equation")


def evaluate_equation(equation: str) -> float | None:
    """Value of an arithmetic equation, or None when it is not one (or divides by zero)."""
    if len(equation) > _MAX_EQ_CHARS or not _ALLOWED.match(equation):
        return None
    try:
        return float(_eval(ast.parse(equation, mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def _ground_truth(ground_truth: Any) -> tuple[float, list[int]]:
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    try:
        return float(gt["target"]), sorted(int(n) for n in gt["numbers"])
    except (TypeError, KeyError, ValueError) as e:
        # A data error, not a model error: it goes to reward.on_error with this message.
        raise ValueError(f"countdown ground_truth must be {{'target': int, 'numbers': [int, ...]}}, got {ground_truth!r}") from e


@register_reward("countdown")
def countdown(solution_str: str, ground_truth: Any, data_source: str | None = None, extra_info: dict | None = None,
              format_score: float = 0.1, score: float = 1.0) -> float:
    """``score`` when the ``<answer>`` equation uses each number once and hits the target (verl's rule)."""
    target, numbers = _ground_truth(ground_truth)
    equation = extract_equation(str(solution_str))
    if equation is None:
        return 0.0
    if sorted(int(n) for n in re.findall(r"\d+", equation)) != numbers:
        return float(format_score)
    value = evaluate_equation(equation)
    if value is None:
        return float(format_score)
    return float(score) if abs(value - target) < 1e-5 else float(format_score)
