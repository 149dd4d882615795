"""A judge's answer -> a score (``reward.judge.parse``, mrl/config/judge.py).

    regex: verdict = group 'verdict' (if the pattern names one) else group 1 of the first match
    json:  verdict = the value at the dotted key of the answer's first JSON object
    score = scores[verdict.strip().lower()]   (scores set)   |   float(verdict)   (scores null)

Anything else raises :class:`UnparsableVerdict` naming what was missing: the caller counts it and
applies reward.on_error (never a silent 0).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any


class UnparsableVerdict(ValueError):
    """The judge's answer holds no verdict the parser can read."""


def _regex_verdict(text: str, rx: re.Pattern) -> str:
    m = rx.search(text)
    if m is None:
        raise UnparsableVerdict(f"no match of reward.judge.parse.pattern {rx.pattern!r}")
    v = m.group("verdict") if "verdict" in rx.groupindex else m.group(1)
    if v is None:
        raise UnparsableVerdict(f"reward.judge.parse.pattern {rx.pattern!r} matched but its verdict group is empty")
    return v


def _json_verdict(text: str, key: str) -> Any:
    start = text.find("{")
    if start < 0:
        raise UnparsableVerdict("no JSON object in the answer")
    try:
        obj, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError as e:
        raise UnparsableVerdict(f"the answer's JSON object does not parse ({e})") from None
    for part in key.split("."):
        if not isinstance(obj, dict) or part not in obj:
            raise UnparsableVerdict(f"the answer's JSON has no key {key!r} (reward.judge.parse.key)")
        obj = obj[part]
    return obj


def parse_verdict(text: str, *, type: str = "regex", pattern: str | re.Pattern = r"(?i)\b(yes|no)\b",
                  key: str = "score", scores: dict[str, float] | None = None) -> float:
    """The score of one judge answer ``text`` (module doc)."""
    if type == "regex":
        verdict: Any = _regex_verdict(text, pattern if isinstance(pattern, re.Pattern) else re.compile(pattern))
    elif type == "json":
        verdict = _json_verdict(text, key)
    else:
        raise ValueError(f"reward.judge.parse.type must be regex or json, got {type!r}")
    if scores is not None:
        table = {k.strip().lower(): float(v) for k, v in scores.items()}
        got = str(verdict).strip().lower()
        if got not in table:
            raise UnparsableVerdict(f"verdict {got!r} is not in reward.judge.parse.scores {sorted(table)}")
        return table[got]
    if isinstance(verdict, bool):
        raise UnparsableVerdict(f"verdict {verdict!r} is a boolean, not a number (map it with reward.judge.parse.scores)")
    try:
        value = float(verdict)
    except (TypeError, ValueError):
        raise UnparsableVerdict(f"verdict {verdict!r} is not a number (reward.judge.parse.scores is null)") from None
    if not math.isfinite(value):
        raise UnparsableVerdict(f"verdict {verdict!r} is not finite")
    return value
