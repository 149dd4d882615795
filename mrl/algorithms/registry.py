"""Name -> function registries that refuse duplicates and list the valid names on a miss.

Used for policy losses (``get_policy_loss_fn`` / ``register_policy_loss``) and advantage
estimators (``get_adv_estimator`` / ``register_adv_est``), the two extension points verl users
look for (verl's extension points; docs/plugins.md). ``get`` also resolves a plugin spec (``pkg.module:fn`` /
``path/to/file.py:fn``), whose file may register with the same decorators.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from mrl.plugins import FORMS, closest, is_spec, load_callable

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A named table of functions.

    ``kind`` is the human name used in error messages and ``config_key`` the configuration key a
    user sets to pick an entry, so that a miss tells the user which key to fix.
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._table: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@registry.register("name")``; a second function under the same name is an error."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def deco(fn: F) -> F:
            if name in self._table and self._table[name] is not fn:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered by "
                    f"{self._table[name].__module__}.{self._table[name].__qualname__}; "
                    f"pick another name for {fn.__module__}.{fn.__qualname__}"
                )
            self._table[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        """The function registered as ``name``, or the plugin a ``pkg.module:fn`` / ``file.py:fn``
        spec names (``mrl.plugins``); an unknown name lists the closest valid ones."""
        if is_spec(name):
            return load_callable(name, self.config_key, registered=self._table)
        try:
            return self._table[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r} (config key `{self.config_key}`); {closest(name, self._table)}; "
                f"or a plugin: {FORMS}"
            ) from None

    def names(self) -> list[str]:
        """Sorted registered names (for config validation and docs)."""
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table
