"""Run Megatron-Core on CPU over gloo: the one place in mrl that knows about the CPU device.

Megatron-Core (0.16) assumes CUDA in a handful of places that are not about maths. With the
redirects below, ``GPTModel`` forward/backward, ``get_forward_backward_func()`` (1F1B, TP×PP),
Megatron ``DistributedDataParallel`` and the ``DistributedOptimizer`` run on CPU tensors with
the gloo backend, so CI and the CPU quickstart exercise the real TP/PP code paths.

Redirects (each has its own test in ``tests/megatron/test_cpu_support.py``):

1. ``torch.cuda.current_device()`` returns ``0`` (an ordinal Megatron feeds back as ``device=``).
2. A ``TorchFunctionMode`` (:class:`CpuDeviceMode`) rewrites every CUDA device argument —
   ``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")`` or a bare ordinal ``N`` — to ``"cpu"`` in
   factory calls (``torch.empty(..., device=...)``) and in ``Tensor.to(...)``; it drops
   ``pin_memory=True`` (pinning needs a CUDA driver).
3. ``Tensor.cuda()`` and ``Tensor.pin_memory()`` return the CPU tensor itself.
4. ``Tensor.type()`` (no argument) reports ``torch.cuda.<T>Tensor`` because the optimizer and
   grad clipping assert on those strings; ``Tensor.type("torch.cuda.<T>Tensor")`` casts to the
   CPU type.
5. The CUDA RNG tracker: ``torch.cuda.{get,set}_rng_state`` / ``manual_seed`` and Megatron's
   ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` use the CPU generator, so
   ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` work (forked
   streams stay reproducible, the tensor-parallel stream differs per TP rank as on GPU). The
   tracker's "CPU RNG state changed within GPU RNG context" warning is filtered out: on CPU the
   two generators are one, so every forked draw trips it.
6. ``torch.cuda.Stream`` / ``stream`` / ``current_stream`` / ``default_stream`` become a no-op
   stream (CPU ops are synchronous), ``torch.cuda.synchronize`` a no-op.
7. Megatron's unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``) runs as one autograd
   function (:mod:`mrl.megatron.rope_kernel`, tested in ``tests/megatron/test_rope_kernel.py``): the
   CPU's stand-in for TE's fused RoPE.
8. MoE all-to-all dispatch: the split sizes the dispatcher moves "device to host" become numpy
   arrays on CPU as they do from CUDA (``maybe_move_tensor_to_cpu`` only converts CUDA tensors, and
   ``all_to_all_single`` takes sequences, not tensors); the stream's recorded event is a completed
   no-op event (:class:`_NoOpEvent`).
9. Megatron's communication autograd functions (``tensor_parallel.mappings``: all-to-all,
   sequence-parallel gathers and reduce-scatters) see ``torch.cuda.current_device()`` as ``"cpu"``
   (a view of ``torch`` in that module's globals, :class:`_TorchView`): their *backward* runs
   inside the handler of ``torch.autograd.backward``, where a function mode is switched off, so
   redirect 2 cannot rewrite the ``device=`` they allocate with there.

10. Multi-latent attention's ``YarnRotaryEmbedding`` is built with ``use_cpu_initialization=True``: MLA does
   not pass the config's flag, so it would build its frequency tables under ``torch.device(<CUDA ordinal>)``,
   a device context the function mode of redirect 2 cannot rewrite (:func:`_cpu_yarn_init`).

Scope: :func:`cpu_support` is a reversible context (the patches are undone when the last user
leaves); :func:`enable_cpu_support` enters it for a thread's lifetime and is called only when
``device == "cpu"`` (by :func:`mrl.megatron.parallel.init_parallel` and the trainer rank's
per-call hook), so nothing here runs with ``device: cuda``. It does
work on a host that has GPUs (CPU tests on a GPU host): the process then treats every CUDA
request as CPU, which is what ``device: cpu`` asks for. The module-level patches are process-wide; the device mode is a
``torch`` function mode, which is thread-local: call :func:`enable_cpu_support` (idempotent) in
every thread that runs Megatron code.

Processes spawned by ``dist_checkpointing.save`` (its async writer) re-import the entry module,
so entry points that use Megatron must keep their work under ``if __name__ == "__main__":``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_STATE = threading.local()
_PATCHED = False
_LOCK = threading.Lock()


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    # A bare ordinal means a CUDA device to torch (torch.empty(2, device=0) is cuda:0).
    return isinstance(dev, int) and not isinstance(dev, bool)


def _cpu_type_name(name: str) -> str:
    return name.replace("torch.cuda.", "torch.", 1) if name.startswith("torch.cuda.") else name


# The calls the mode rewrites by function; everything else only for a ``device``/``pin_memory`` keyword.
_REWRITTEN = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.to, torch.Tensor.type})


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU in every torch call (redirects 2-4)."""

    def __torch_function__(self, func: Callable, types, args=(), kwargs=None):  # type: ignore[override]
        # Fast path first: the mode sees every torch call of the forward/backward (~1600 per update of
        # the tiny benchmark model); most have no keyword it would touch.
        if func not in _REWRITTEN and (not kwargs or ("device" not in kwargs and not kwargs.get("pin_memory"))):
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to:
            # Tensor.to(device[, dtype]) puts the device first; Tensor.to(other) is left as is.
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        if func is torch.Tensor.type:
            if len(args) == 1 and "dtype" not in kwargs:
                name = func(*args, **kwargs)
                return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], _cpu_type_name(args[1]), *args[2:])
            if isinstance(kwargs.get("dtype"), str):
                kwargs["dtype"] = _cpu_type_name(kwargs["dtype"])
        return func(*args, **kwargs)


class _NoOpEvent:
    """What :meth:`_NoOpStream.record_event` returns: already complete (CPU work is synchronous).
    Megatron's all-to-all MoE dispatcher waits on such an event before reading its split sizes."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``: CPU kernels run synchronously, so nothing to order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CudaView:
    """``torch.cuda`` as the mappings module sees it under CPU support (redirect 9)."""

    def __getattr__(self, name: str) -> Any:
        if name == "current_device":
            return lambda: "cpu"
        return getattr(torch.cuda, name)


class _TorchView:
    """``torch`` with :class:`_CudaView` as ``cuda``; every other attribute is torch's own."""

    cuda = _CudaView()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Megatron's ``maybe_move_tensor_to_cpu`` for tensors that already are on the host (redirect 8)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


class _DropSameGeneratorWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _cpu_yarn_init(original: Callable) -> Callable:
    """Redirect 10: ``YarnRotaryEmbedding.__init__`` with ``use_cpu_initialization=True``."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["use_cpu_initialization"] = True
        original(self, *args, **kwargs)

    return init


def _redirects() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, CPU stand-in) of every process-wide redirect (1, 5, 6, 7, 10 of the docstring)."""
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    from mrl.megatron.rope_kernel import make_rope_bshd

    return [
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy),
        (mappings, "torch", _TorchView()),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", lambda device=None: None),
        (torch.cuda, "Stream", _NoOpStream),
        (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (torch.cuda, "current_stream", lambda device=None: _NoOpStream()),
        (torch.cuda, "default_stream", lambda device=None: _NoOpStream()),
        # The "CUDA" generator is the CPU one: fork/restore semantics of the tracker are preserved.
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state)),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (mrandom, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)),
        (rope_utils, "_apply_rotary_pos_emb_bshd", make_rope_bshd(rope_utils._apply_rotary_pos_emb_bshd)),
        (YarnRotaryEmbedding, "__init__", _cpu_yarn_init(YarnRotaryEmbedding.__init__)),
    ]


_SAVED: list[tuple[Any, str, Any]] = []  # originals while patched
_USERS = 0  # open cpu_support() contexts and enable_cpu_support() threads, all threads together
_FILTER = _DropSameGeneratorWarning()


def _patch_process_wide() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    for owner, name, stand_in in _redirects():
        _SAVED.append((owner, name, getattr(owner, name)))
        setattr(owner, name, stand_in)
    logging.getLogger(mrandom.__name__).addFilter(_FILTER)


def _unpatch_process_wide() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    while _SAVED:
        owner, name, original = _SAVED.pop()
        setattr(owner, name, original)
    logging.getLogger(mrandom.__name__).removeFilter(_FILTER)


def _acquire() -> None:
    global _PATCHED, _USERS
    with _LOCK:
        if _USERS == 0:
            _patch_process_wide()
            _PATCHED = True
        _USERS += 1


def _release() -> None:
    global _PATCHED, _USERS
    with _LOCK:
        _USERS -= 1
        if _USERS == 0:
            _unpatch_process_wide()
            _PATCHED = False


@contextlib.contextmanager
def cpu_support():
    """Every redirect of the module docstring while the block runs on this thread; on exit the
    device mode leaves this thread and, when no other context or thread uses them, the process-wide
    patches are undone (``torch.cuda`` and Megatron's RNG helpers are their originals again)."""
    _acquire()
    mode = CpuDeviceMode()
    mode.__enter__()
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth
        mode.__exit__(None, None, None)
        _release()


def enable_cpu_support() -> None:
    """Enter :func:`cpu_support` for the rest of this thread's life (idempotent per thread).

    What a trainer-rank process does (``init_parallel`` on ``device="cpu"``, the rank's
    ``before_call`` on each thread Ray runs its methods on): Megatron's models, optimizer and RNG
    tracker are built under the redirects and used under them until the process exits."""
    if getattr(_STATE, "mode", None):
        return
    _acquire()
    mode = CpuDeviceMode()
    mode.__enter__()  # stays on this thread's function-mode stack: the rank process lives under it
    _STATE.mode = mode


def cpu_support_active() -> bool:
    """True when the redirects are on for this thread (a :func:`cpu_support` block or
    :func:`enable_cpu_support`)."""
    return _PATCHED and (getattr(_STATE, "mode", None) is not None or getattr(_STATE, "depth", 0) > 0)
