"""Megatron's and torch's fallback warnings, collected and reported once instead of printed per rank.

Megatron-Core warns at import time about every missing optional kernel (Apex norms, Transformer
Engine / Apex fused Adam and multi-tensor ops) and torch warns about the deprecated collectives
Megatron still calls: ~15 lines per rank on a CPU run, each true but none actionable there. A rank
process calls :func:`collect_fallbacks` before it imports Megatron; the known messages are then
recorded (:func:`fallbacks_in_use`) instead of printed, and the driver prints one line naming them
(:func:`summary_line`). Every other warning is shown as before.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Iterable

# (pattern of the warning text, what it means for the run)
KNOWN: tuple[tuple[re.Pattern[str], str], ...] = tuple((re.compile(p), what) for p, what in (
    (r"Apex is not installed\. Falling back to Torch Norm", "torch LayerNorm/RMSNorm (no Apex)"),
    (r"Falling back to Torch optimizers", "torch Adam (no Transformer Engine/Apex fused Adam)"),
    (r"Falling back to local implementations of multi_tensor", "Megatron's local multi_tensor_* ops (no TE/Apex)"),
    (r"full scope is deprecated\. Use empty cuda_graph_scope", "Megatron's default cuda_graph_scope (deprecation notice)"),
    (r"`torch\.distributed\.(\w+)` is deprecated", r"torch.distributed.\1 as Megatron calls it (deprecated name)"),
    # DistributedOptimizer.zero_grad touches .grad of its fp32 shard views (Megatron's own comment there:
    # "throws grad-access warning"); printed by each rank at its first update, harmless.
    (r"\.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
     "Megatron's DistributedOptimizer.zero_grad on its shard views (torch's non-leaf .grad notice)"),
))

_seen: dict[str, None] = {}  # insertion-ordered set
_installed = False


def classify(message: str) -> str | None:
    """What a known fallback warning means (None for any other warning)."""
    for pattern, what in KNOWN:
        m = pattern.search(message)
        if m:
            return m.expand(what)
    return None


def collect_fallbacks() -> None:
    """Record the known fallback warnings of this process instead of printing them (idempotent)."""
    global _installed
    if _installed:
        return
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        what = classify(str(message))
        if what is None:
            show(message, category, filename, lineno, file, line)
        else:
            _seen.setdefault(what)

    warnings.showwarning = showwarning
    _installed = True


def fallbacks_in_use() -> list[str]:
    """The fallbacks this process hit, in the order they were first seen."""
    return list(_seen)


def summary_line(per_process: Iterable[Iterable[str]]) -> str | None:
    """One line for the console from every process's :func:`fallbacks_in_use` (None when there were none)."""
    seen: dict[str, None] = {}
    for items in per_process:
        for what in items:
            seen.setdefault(what)
    if not seen:
        return None
    return "fallbacks in use (expected without Transformer Engine/Apex, e.g. on CPU): " + "; ".join(seen)
