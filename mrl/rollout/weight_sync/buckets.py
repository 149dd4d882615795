"""Flat byte buckets of HF-named tensors, the unit the ``distributed`` transport broadcasts.

Packing (SGLang's ``load_format="flattened_bucket"`` convention): the tensors of one bucket,
in the order of ``names``, each made contiguous and viewed as bytes, are concatenated into one
uint8 vector ``flat`` [sum_i numel_i * itemsize_i]. The receiver allocates the same vector from
``names/dtypes/shapes`` alone, receives one broadcast and slices it back, so mixed dtypes share a
bucket and one collective moves the whole bucket.

Alignment: the receiver views ``flat[offset:offset + nbytes]`` as each tensor's dtype and SGLang
refuses an offset that is not a multiple of the itemsize ("Unaligned received tensor"). Packing
has no padding, so each bucket orders its tensors by itemsize, largest first: every offset is then
a sum of sizes of tensors whose itemsize is a multiple of the current one (itemsizes are powers of
two), hence aligned. ``names`` travels in that order.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang names dtypes as ``getattr(torch, name)`` expects: torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Bucket:
    """names/dtypes/shapes as sent in ``update_weights_from_distributed``; tensors kept for packing."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(t.dtype) for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(t) for t in self.tensors)

    def flatten(self) -> torch.Tensor:
        """uint8 [nbytes] on the tensors' device (the first tensor's)."""
        return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in self.tensors])

    def aligned(self) -> Bucket:
        """The same tensors ordered by itemsize, largest first (stable), so every offset in the
        flat vector is a multiple of its tensor's itemsize (see the module docstring)."""
        order = sorted(range(len(self.tensors)), key=lambda i: -self.tensors[i].element_size())
        return Bucket([self.names[i] for i in order], [self.tensors[i] for i in order])


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors greedily in arrival order into buckets of at most ``bucket_bytes``; a tensor
    larger than the limit travels alone (splitting one tensor would need a receiver that
    reassembles, which SGLang's does not)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes; set rollout.weight_sync.bucket_mb > 0")
    cur = Bucket()
    for name, t in named_tensors:
        nb = tensor_nbytes(t)
        if cur.tensors and cur.nbytes + nb > bucket_bytes:
            yield cur.aligned()
            cur = Bucket()
        cur.names.append(name)
        cur.tensors.append(t)
    if cur.tensors:
        yield cur.aligned()


def unflatten(flat: torch.Tensor, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``Bucket.flatten`` from the metadata alone (what a receiver does)."""
    out, off = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        dtype = getattr(torch, dt)
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if off % itemsize:
            raise ValueError(f"unaligned tensor {name!r} in flat bucket: byte offset {off} is not a multiple of "
                             f"{dt}'s itemsize {itemsize} (order a bucket's tensors by itemsize, largest first)")
        nb = numel * itemsize
        out.append((name, flat[off:off + nb].view(dtype).reshape(shape)))
        off += nb
    if off != flat.numel():
        raise ValueError(f"flat bucket has {flat.numel()} bytes but metadata describes {off}")
    return out
