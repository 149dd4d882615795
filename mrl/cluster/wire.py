"""Torch tensors through Ray as raw bytes in a NumPy array.

Ray pickles a ``torch.Tensor`` argument or result through torch's own ``__reduce_ex__`` (storage
objects, typed-storage rebuilds): a driver -> rank call carrying one step's ``TrainBatch`` costs
more that way than with the same bytes as NumPy arrays, which Ray moves as out-of-band pickle-5
buffers (docs/performance.md, 'Tensors through Ray as bytes'; a small run pays this on every phase
call). So a plain CPU tensor travels as ``(uint8 array of its bytes, dtype, shape)``
and is rebuilt as a fresh tensor that owns a copy of them: writable, and not a view into Ray's
message or object-store buffer (which is read-only). Exact for every dtype, bf16 and bool included:
the bytes are the tensor's.

Everything else — CUDA tensors, tensors that require grad, sparse/quantized/nested layouts — keeps
torch's own pickling (``("pickle", bytes)``). Subclasses such as ``nn.Parameter`` are not affected: Ray
dispatches custom serializers on the exact type.

Registration is per process and one-sided: the sender's serializer names the deserializer, a
module-level function the receiver imports, so a process that never registered still reads these
tensors. The driver registers in ``init_ray``, every rank actor when it starts.
"""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch


def _plain(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
            and not t.is_quantized and not t.is_nested)


def tensor_to_wire(t: torch.Tensor) -> tuple[Any, ...]:
    """``("raw", bytes as uint8 ndarray, dtype name, shape)``, or ``("pickle", bytes)`` for the rest."""
    if not _plain(t):
        return ("pickle", pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return ("raw", flat.view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape))


def tensor_from_wire(w: tuple[Any, ...]) -> torch.Tensor:
    if w[0] == "pickle":
        return pickle.loads(w[1])  # what Ray itself would have unpickled: torch's pickling of the tensor
    _, raw, dtype, shape = w
    if raw.size == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))  # owned, writable
    return data.view(getattr(torch, dtype)).reshape(shape)


def register_tensor_wire() -> None:
    """Use this encoding for every ``torch.Tensor`` this process sends through Ray (idempotent)."""
    import ray.util

    ray.util.register_serializer(torch.Tensor, serializer=tensor_to_wire, deserializer=tensor_from_wire)
