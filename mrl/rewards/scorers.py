"""Built-in rule scorers (``reward.function=<name>``), all returning a float per sample.

* ``gsm8k``: verl-compatible GSM8K rule. ``strict`` takes the last ``#### <number>`` of the
  response (commas and ``$`` removed); ``flexible`` the last number anywhere. Score 1.0 when the
  extracted string equals the ground truth, else 0.0 (format score). Only the last 300 characters
  are searched, as verl does, to bound regex time on degenerate long responses.
* ``arith``: the quickstart's toy task: the first integer of the response equals the integer
  ground truth → 1.0, else 0.0.
* ``exact_match``: stripped response equals stripped ground truth → 1.0.
"""
from __future__ import annotations

import re

from mrl.rewards.registry import register_reward

_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"(-?[0-9.,]+)")
_INT = re.compile(r"-?\d+")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer string of a GSM8K response, or None (``method`` strict | flexible)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_NUMBER.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


@register_reward("gsm8k")
def gsm8k(solution_str: str, ground_truth: str, data_source: str | None = None, extra_info: dict | None = None,
          method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> float:
    """1.0 when the extracted final answer equals ``ground_truth`` (verl ``gsm8k.compute_score``)."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth).strip() else float(format_score)


@register_reward("arith")
def arith(solution_str: str, ground_truth: str | int, data_source: str | None = None,
          extra_info: dict | None = None) -> float:
    """1.0 when the first integer in the response equals ``int(ground_truth)``, else 0.0."""
    m = _INT.search(solution_str)
    if m is None:
        return 0.0
    return 1.0 if int(m.group()) == int(str(ground_truth).strip()) else 0.0


@register_reward("exact_match")
def exact_match(solution_str: str, ground_truth: str, data_source: str | None = None,
                extra_info: dict | None = None) -> float:
    """1.0 when the stripped response equals the stripped ground truth, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
