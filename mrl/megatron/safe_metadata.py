"""Read torch DCP's ``.metadata`` without unpickling arbitrary objects.

torch's ``FileSystemReader.read_metadata`` (which Megatron's ``dist_checkpointing`` loads through)
calls ``pickle.load`` on ``<ckpt>/.metadata``: a crafted file in a checkpoint directory runs code in
every process that resumes from it or inspects it. The index only ever holds a handful of torch
types (the DCP metadata dataclasses, ``torch.Size``, dtypes, the layout/memory-format encodings),
so a restricted unpickler that resolves exactly those globals and refuses everything else loads
every genuine checkpoint and no payload.

:func:`install` points torch's DCP filesystem module at that unpickler, so every reader in the
process (Megatron's strategies, ``dcp.load``, ``mrl-ckpt``) goes through it; it is called by each
mrl entry point that reads a checkpoint (:mod:`mrl.megatron.checkpoint`).
"""
from __future__ import annotations

import io
import pickle
import types
from pathlib import Path
from typing import Any

_MD = "torch.distributed.checkpoint.metadata"
_PLAN = "torch.distributed.checkpoint.planner"
# Exactly the record types a DCP index holds (dataclasses and enums: building them runs no user
# code), plus the plain containers/paths a StorageMeta may carry.
_ALLOWED = {
    *((_MD, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                         "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "_MEM_FORMAT_ENCODING")),
    *((_PLAN, n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                           "BytesIOWriteData", "LoadPlan", "ReadItem", "LoadItemType")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class UnsafeCheckpointMetadata(pickle.UnpicklingError):
    """``.metadata`` refers to something other than torch DCP metadata types."""


def _allowed(module: str, name: str) -> bool:
    import torch

    if (module, name) in _ALLOWED:
        return True
    # dtypes, memory formats and layouts are plain values (not callables).
    return module == "torch" and isinstance(
        getattr(torch, name, None), torch.dtype | torch.memory_format | torch.layout
    )


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise UnsafeCheckpointMetadata(
                f"refers to {module}.{name}, which is not a torch checkpoint metadata type"
            )
        return super().find_class(module, name)


def restricted_load(file: Any, **_: Any) -> Any:
    """``pickle.load`` that resolves only torch DCP metadata globals (others raise)."""
    return _RestrictedUnpickler(file).load()


def restricted_loads(data: bytes) -> Any:
    return restricted_load(io.BytesIO(data))


def load_dcp_metadata(ckpt_dir: str | Path) -> Any:
    """The ``Metadata`` of ``<ckpt_dir>/.metadata``, read with the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(ckpt_dir) / ".metadata"
    with open(path, "rb") as f:
        md = restricted_load(f)
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointMetadata(f"holds a {type(md).__name__}, not a torch DCP Metadata")
    return md


class _SafePickleModule(types.ModuleType):
    """Stand-in for ``pickle`` inside torch's DCP filesystem module: loads are restricted,
    everything else (``dump`` for saving) is the real module's."""

    load = staticmethod(restricted_load)
    loads = staticmethod(restricted_loads)

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)


def install() -> None:
    """Make torch DCP's ``FileSystemReader.read_metadata`` use the restricted unpickler (idempotent)."""
    import torch.distributed.checkpoint.filesystem as fs

    if not isinstance(fs.pickle, _SafePickleModule):
        fs.pickle = _SafePickleModule("pickle")
