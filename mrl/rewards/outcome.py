"""What one scoring call returned, checked against the scorer contract (verl's ``compute_score``).

A scorer returns either a number (``float``/``int``/``bool``, or a 1-element array/tensor) or a dict::

    {"score": 1.0, "acc": True, "pred": "42", "format_ok": 1.0}

``score`` is the reward. Every key — ``score`` included, as verl's ``NaiveRewardManager`` does —
becomes ``reward_extra_info``: per-sample lists that validation turns into extra metric variables
(``acc``, ``format_ok``) and into the majority vote of ``maj@k`` (``pred``). Values must be finite
numbers, except ``pred``, which is the voted answer: ``str`` or ``None`` (no answer extracted).

Imports neither torch nor numpy: this runs inside spawned scoring workers.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

ExtraValue = float | str | None  # a numeric key's value as float; pred as str or None
RESERVED = ("reward",)  # validation's own variable (the summed token-level score), verl appends it too

_FIX = ('fix: return a finite number, or a dict {"score": <finite number>, <key>: <finite number>, ..., '
        '"pred": <str or None>} (docs/rewards.md)')


class ScoreContractError(ValueError):
    """The scorer returned something outside the contract: a bug in the scorer, never data for on_error."""


class Outcome(NamedTuple):
    """One call. Exactly one of: scored (``score`` set), failed (``error``) or broke the contract (``broken``)."""

    score: float | None
    extra: dict[str, ExtraValue] | None  # {} for a plain number; the dict's keys (score included) otherwise
    error: str | None = None   # raised, timed out or its worker died -> reward.on_error decides
    broken: str | None = None  # returned a value outside the contract -> always raises


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (numpy scalars, 1-element arrays/tensors too), else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # np.bool_, 0-d np.ndarray, torch scalar tensors
    if callable(item):
        try:
            out = item()
        except (TypeError, ValueError, RuntimeError):  # more than one element
            return None
        return float(out) if isinstance(out, numbers.Real) else None
    return None


def parse_return(value: Any) -> tuple[float, dict[str, ExtraValue]]:
    """(score, extra) of a scorer's return value; ``ScoreContractError`` names what is wrong and the fix."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ScoreContractError(f"returned a dict without 'score' (keys {sorted(map(str, value))}); {_FIX}")
        extra: dict[str, ExtraValue] = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise ScoreContractError(f"returned a dict with non-string key {key!r}; {_FIX}")
            if key in RESERVED:
                raise ScoreContractError(f"returned key {key!r}, which validation uses for the summed score; "
                                         f"rename it; {_FIX}")
            if key == "pred":
                if v is not None and not isinstance(v, str):
                    raise ScoreContractError(f"'pred' must be a str or None (it is the majority-vote answer), "
                                             f"got {type(v).__name__} {v!r}; return str(pred)")
                extra[key] = v
                continue
            x = _number(v)
            if x is None or not math.isfinite(x):
                what = f"{type(v).__name__} {v!r}"[:120]
                raise ScoreContractError(f"returned {key!r}={what}: every key except 'pred' must be a finite number; "
                                         f"{_FIX}")
            extra[key] = x
        return float(extra["score"]), extra
    x = _number(value)
    if x is None:
        raise ScoreContractError(f"returned {type(value).__name__} {value!r}"[:200] + f"; {_FIX}")
    if not math.isfinite(x):
        raise ScoreContractError(f"returned a non-finite score {x}; {_FIX}")
    return x, {}


# |score| above this is a bug, not a reward: float32 group statistics overflow near 1e19 (the
# variance squares it) and 1e38 already zeroes its group's advantages; 1e6 leaves every sane scale.
MAX_ABS_SCORE = 1e6


def _bad_value(value: Any) -> str | None:
    """Why a plain return value is not a usable score of this sample (None when it is)."""
    if isinstance(value, Mapping):
        return None  # dict contract checked by parse_return
    x = _number(value)
    if x is None:
        return f"returned {type(value).__name__} {value!r}"[:200] + " (not a number)"
    if not math.isfinite(x):
        return f"returned a non-finite score {x}"
    if abs(x) > MAX_ABS_SCORE:
        return f"returned the score {x:.3g}, beyond +-{MAX_ABS_SCORE:g} (absurd for a reward; would overflow the advantages)"
    return None


def score_one(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Outcome:
    """Call ``fn(**kwargs)`` and check its return value. Exceptions raised by ``fn`` and a per-sample bad
    value (a non-number, NaN/inf, or beyond ``MAX_ABS_SCORE``) become ``error`` (``reward.on_error``
    applies, counted); a dict outside the contract becomes ``broken``."""
    try:
        value = fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - any scorer failure is data for on_error
        return Outcome(None, None, error=f"{type(e).__name__}: {e}")
    bad = _bad_value(value if not isinstance(value, Mapping) else value.get("score", 0.0))
    if bad is not None:
        return Outcome(None, None, error=f"BadScore: {bad}")
    try:
        score, extra = parse_return(value)
    except ScoreContractError as e:
        return Outcome(None, None, broken=str(e))
    return Outcome(score, extra)
