"""Rollout-correction option names and threshold parsing (verl's rules), torch-free: shared by the
config (errors at `mrl plan` time, mrl/config/algorithm.py) and :mod:`mrl.algorithms.rollout_correction`."""
from __future__ import annotations

import math

RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)
IS_LEVELS: tuple[str, ...] = ("token", "sequence")


def _number(text: str) -> float:
    """A finite float written without digit separators (float() reads '0.5_2' as 0.52, 'inf' and
    '1e400' as infinity: a band or cap that never binds). ValueError otherwise."""
    text = text.strip()
    if "_" in text:
        raise ValueError(text)
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(text)
    return x


def parse_is_threshold(spec: str | float, key: str = "algorithm.rollout_correction.rollout_is_threshold"
                       ) -> tuple[float, float | None]:
    """``U`` or ``"L_U"`` -> ``(U, L or None)``; an error naming ``key`` when malformed."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"{key} must be a number U (TIS) or a string 'L_U' (IcePop), got {spec!r}; fix: e.g. 2.0 or '0.5_5.0'")
    lower = None
    try:
        if isinstance(spec, str) and "_" in spec:
            lo, hi = spec.strip().split("_", 1)
            lower, upper = _number(lo), _number(hi)
        else:
            upper = _number(str(spec))
    except ValueError:
        raise ValueError(f"{key}={spec!r} is not a finite number U or 'L_U'; fix: e.g. 2.0 (TIS) or '0.5_5.0' (IcePop)") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{key}={spec!r}: need U > 0 and, for 'L_U', 0 < L <= U; fix: e.g. 2.0 or '0.5_5.0'")
    return upper, lower


def parse_rs(options: str, spec: str | float | None,
             key: str = "algorithm.rollout_correction") -> dict[str, tuple[float | None, float]]:
    """``rollout_rs`` / ``rollout_rs_threshold`` -> ``{option: (lower or None, upper)}`` (verl's rules:
    one threshold shared by all options or one per option; ``k1`` options ``L_U`` or ``U`` = ``[1/U, U]``)."""
    opts = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    if not opts:
        raise ValueError(f"{key}.rollout_rs={options!r} names no option; fix: one or more of {', '.join(RS_OPTIONS)}")
    bad = [o for o in opts if o not in RS_OPTIONS]
    if bad:
        raise ValueError(f"{key}.rollout_rs: unknown option(s) {', '.join(bad)}; fix: use {', '.join(RS_OPTIONS)}")
    if spec is None or isinstance(spec, bool):
        raise ValueError(f"{key}.rollout_rs={options!r} needs {key}.rollout_rs_threshold; fix: set it (e.g. 2.0, or '0.5_2.0' for k1)")
    raw = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(raw) not in (1, len(opts)):
        raise ValueError(f"{key}.rollout_rs_threshold={spec!r}: fix: give one threshold or {len(opts)} (one per option)")
    raw = raw * len(opts) if len(raw) == 1 else raw
    out: dict[str, tuple[float | None, float]] = {}
    for opt, s in zip(opts, raw):
        try:
            if opt.endswith("k1"):
                lo, hi = s.split("_", 1) if "_" in s else (str(1.0 / _number(s)), s)
                lower, upper = _number(lo), _number(hi)
                if not (0 < lower <= upper):
                    raise ValueError
                out[opt] = (lower, upper)
            else:
                upper = _number(s)
                if not upper > 0:
                    raise ValueError
                out[opt] = (None, upper)
        except (ValueError, ZeroDivisionError):
            form = "finite 'L_U' with 0 < L <= U or U > 0" if opt.endswith("k1") else "one upper bound > 0, finite"
            raise ValueError(f"{key}.rollout_rs_threshold: {s!r} for option {opt}; fix: {form}") from None
    return out
