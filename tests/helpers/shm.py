"""The sender side of ``update_weights_from_tensor`` in the engine tests: tensors back to back in one segment."""
from __future__ import annotations

import uuid
from multiprocessing import shared_memory

import torch


def tensors_to_shm(tensors: dict[str, torch.Tensor]) -> tuple[shared_memory.SharedMemory, list[dict]]:
    """One shared-memory segment holding every tensor (a flat bucket) and the request's ``shm_tensors`` specs;
    the caller closes and unlinks the segment."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shm = shared_memory.SharedMemory(name=f"mrl_test_{uuid.uuid4().hex[:8]}", create=True, size=total)
    specs, off = [], 0
    for n, t in tensors.items():
        nb = t.numel() * t.element_size()
        shm.buf[off:off + nb] = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        specs.append({"name": n, "shm_name": shm.name, "dtype": str(t.dtype).replace("torch.", ""),
                      "shape": list(t.shape), "offset": off})
        off += nb
    return shm, specs
