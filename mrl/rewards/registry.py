"""Reward scorer registry and custom-function loading (``reward.function``).

A scorer maps one sample to a float, or to a dict with a ``score`` and extra keys (verl's
``reward_extra_info``; the contract is in ``mrl.rewards.outcome``)::

    fn(solution_str: str, ground_truth: str, data_source: str | None = None,
       extra_info: dict | None = None) -> float | dict

It is always called with keyword arguments, the convention of verl's ``compute_score`` custom
reward functions, so a verl scorer module loads unchanged with ``reward.function=file.py:compute_score``.
``reward.function`` takes a registry name (``gsm8k``), ``pkg.module:fn`` or ``path/to/file.py:fn``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from mrl.plugins import FORMS, closest, load_callable

ScoreFn = Callable[..., float | dict[str, Any]]

_REGISTRY: dict[str, ScoreFn] = {}
_BUILTIN_MODULES = ("mrl.rewards.scorers", "mrl.rewards.math_verify_scorer", "mrl.rewards.countdown")
_FIX = "fix: reward.function=<registry name> | pkg.module:fn | path/to/file.py:fn"


def register_reward(name: str) -> Callable[[ScoreFn], ScoreFn]:
    """Decorator ``@register_reward("name")``; a different function under a taken name is an error."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':', got {name!r}")

    def deco(fn: ScoreFn) -> ScoreFn:
        old = _REGISTRY.get(name)
        # Same qualified name = the module was re-imported (e.g. in a spawned worker): not a clash.
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(
                f"reward {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
                f"pick another name for {fn.__module__}.{fn.__qualname__}"
            )
        _REGISTRY[name] = fn
        return fn

    return deco


def reward_names() -> list[str]:
    """Sorted names of the registered scorers (built-ins included)."""
    _load_builtins()
    return sorted(_REGISTRY)


def _load_builtins() -> None:
    # Imported lazily: scorers register themselves on import, and registry must not import them at
    # module level (they import this module).
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def get_reward_fn(spec: str | ScoreFn) -> ScoreFn:
    """Resolve ``reward.function``: a callable passes through; else registry name, ``pkg.mod:fn`` or ``file.py:fn``."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward.function must be a non-empty string, got {spec!r}; {_FIX}")
    if ":" not in spec:
        _load_builtins()
        if spec not in _REGISTRY:
            raise ValueError(f"unknown reward {spec!r} (config key `reward.function`); {closest(spec, _REGISTRY)}; "
                             f"or a plugin: {FORMS}")
        return _REGISTRY[spec]
    return load_callable(spec, "reward.function", registered=_REGISTRY)
