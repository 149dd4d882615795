"""Move a trained role's parameters, gradients and optimizer state off the device and back.

Colocated mode shares devices between the actor and the rollout engines (verl's hybrid
engine): while the engines generate, the actor's memory is handed back. The mechanism works on
storages, not on tensors: every distinct storage behind a parameter, its ``main_grad`` (the DDP
grad buffer) and the optimizer state is copied to host memory (pinned on CUDA) and then resized
to 0 bytes, so Megatron's views into its contiguous param/grad buffers stay valid objects; the
onload resizes each storage back and copies the bytes in. Tensor identities, views and the
optimizer's references survive the round trip, which is what lets Megatron continue unchanged.

On a CPU device there is nothing to free: :func:`offload_state` is a no-op unless ``force``
(tests use ``force`` to exercise the round trip on CPU).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Offloaded:
    """Host copies of the storages that were freed on the device."""

    entries: list[tuple[Any, torch.Tensor]]  # (untyped storage, host bytes)


def _tensors(mm, optimizer) -> Iterable[torch.Tensor]:
    for c in mm.chunks:
        for p in c.parameters():
            yield p
            g = getattr(p, "main_grad", None)
            if g is not None:
                yield g
            if p.grad is not None:
                yield p.grad
        bufs = getattr(c, "buffers", None)  # DDP's contiguous param/grad buffers; on a bare module
        for buf in bufs if isinstance(bufs, (list, tuple)) else []:  # (frozen RM) it is the buffers() method
            for name in ("param_data", "grad_data"):
                t = getattr(buf, name, None)
                if isinstance(t, torch.Tensor):
                    yield t
    if optimizer is not None:
        opts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        for opt in opts:
            inner = getattr(opt, "optimizer", opt)
            for state in inner.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        yield v
            for group in inner.param_groups:  # fp32 master copies of the DistributedOptimizer
                for p in group["params"]:
                    yield p


def offload_state(mm, optimizer=None, *, force: bool = False) -> Offloaded | None:
    """Free the device memory of ``mm``'s model (+ ``optimizer``); returns what ``onload`` needs."""
    if mm.device.type == "cpu" and not force:
        return None
    seen: dict[int, Any] = {}
    for t in _tensors(mm, optimizer):
        st = t.untyped_storage()
        if st.nbytes() > 0 and st.data_ptr() not in seen:
            seen[st.data_ptr()] = st
    entries = []
    pin = mm.device.type == "cuda"
    for st in seen.values():
        host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin)
        host.untyped_storage().copy_(st)
        entries.append((st, host))
    if mm.device.type == "cuda":
        torch.cuda.synchronize()
    for st, _ in entries:
        st.resize_(0)
    if mm.device.type == "cuda":
        torch.cuda.empty_cache()
    return Offloaded(entries)


def onload_state(state: Offloaded | None) -> None:
    """Undo :func:`offload_state` (``None`` = nothing was offloaded)."""
    if state is None:
        return
    for st, host in state.entries:
        st.resize_(host.numel())
        st.copy_(host.untyped_storage())
