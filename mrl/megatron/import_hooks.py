"""Megatron-Core starts a rank ~1.3 s faster: its ``jit_fuser`` decorator defers ``torch.compile``.

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and importing ``megatron.core`` decorates a
dozen fusion functions with it. ``torch.compile`` imports TorchDynamo and Inductor when it *decorates*
(1.26 s of the 2.1 s that importing ``megatron.core`` takes on the project's 2-core host), although
``torch.compile`` compiles nothing before a decorated function first runs, and mrl's configs run none of
them (``bias_activation_fusion`` and ``bias_dropout_fusion`` are off, provider.py). Every rank process
(actor, reference, reward model, teacher, critic, ``mrl-ckpt``) paid it at start-up.

:func:`install` (called when :mod:`mrl.megatron` is imported, before any submodule imports Megatron) puts
a finder on ``sys.meta_path`` that, once ``megatron.core.jit`` has executed, swaps its ``jit_fuser`` for
:func:`lazy_compile`: the same ``torch.compile`` of the same function, made on its first call instead of
at import. Nothing else of Megatron changes; the finder imports nothing itself (importing
:mod:`mrl.megatron` stays torch-free for ``mrl plan``).
"""
from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

_MODULE = "megatron.core.jit"


def lazy_compile(fn: Callable | None = None, **kwargs: Any) -> Callable:
    """``torch.compile(fn, **kwargs)``, made when the returned function is first called."""
    if fn is None:  # used as @lazy_compile(mode=...)
        return functools.partial(lazy_compile, **kwargs)
    compiled: Callable | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **kwargs)
        return compiled(*args, **kw)

    return call


class _DeferMegatronCompile(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_defer(module: Any) -> None:
            exec_module(module)
            import torch  # already imported: megatron.core.jit imports it

            if getattr(module, "jit_fuser", None) is torch.compile:
                module.jit_fuser = lazy_compile

        loader.exec_module = exec_then_defer  # this spec's own loader instance (one per find_spec)
        return spec


def install() -> None:
    """Idempotent; a no-op when ``megatron.core.jit`` was imported before (it then stays as it was)."""
    if _MODULE not in sys.modules and not any(isinstance(f, _DeferMegatronCompile) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferMegatronCompile())
