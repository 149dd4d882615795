"""Per-tensor checksum shared by the engine (``POST /weights_checksum``) and the weight-sync
sender's ``verify`` step, so both sides hash the same bytes the same way.

checksum(t) = sha256( shape as text || float32 little-endian bytes of t, row-major )[:32 hex]

Values are converted to float32 before hashing, so a bf16/fp16 tensor and its exact fp32 upcast
hash the same (casts bf16->fp32 and fp16->fp32 are exact); a tensor that was *rounded* on the way
(fp32 sender -> bf16 engine) hashes differently, which is what verify should catch. Shape is part
of the hash, so a transposed or reshaped tensor never collides with the original.
"""
from __future__ import annotations

import hashlib

import torch


def tensor_checksum(t: torch.Tensor) -> str:
    """32 hex chars identifying ``t``'s shape and values (see module docstring)."""
    h = hashlib.sha256()
    h.update(("x".join(str(s) for s in t.shape) + ";").encode())
    data = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    h.update(data.numpy().tobytes())
    return h.hexdigest()[:32]


def named_checksums(named_tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{name: tensor_checksum(t)}`` in the order given."""
    return {name: tensor_checksum(t) for name, t in named_tensors.items()}
