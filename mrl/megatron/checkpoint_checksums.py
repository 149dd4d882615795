"""Checksums of a checkpoint's files: written into ``mrl_checkpoint.json`` at save (rank 0, after every
rank finished writing) and compared by ``verify_checkpoint`` (the driver before Ray on a resume, and
``mrl-ckpt``), so a flipped byte in a shard is an error naming the file and what it holds instead of
training on NaN. CRC32 (zlib; fast enough to run on every save and resume, docs/performance.md, 'CRC32
checksums'): integrity against corruption, not a signature against tampering
(the tensor index is separately never unpickled as arbitrary objects: safe_metadata.py)."""
from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

_CHUNK = 1 << 22
ROLES = {
    "common.pt": "Megatron's common (non-tensor) state: the LR scheduler and mrl's step counter",
    "metadata.json": "the dist-checkpoint format record",
    ".metadata": "the tensor index (which shard file holds which slice)",
}


def crc32_file(f: Path) -> str:
    crc = 0
    with f.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def file_checksums(path: Path, skip: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """``{relative name: {"size", "crc32"}}`` of every regular file directly in ``path``."""
    return {f.name: {"size": f.stat().st_size, "crc32": crc32_file(f)}
            for f in sorted(path.iterdir()) if f.is_file() and f.name not in skip}


def role(name: str, held: dict[str, set[str]] | None = None) -> str:
    if name in ROLES:
        return ROLES[name]
    tensors = sorted((held or {}).get(name, ()))
    if tensors:
        return "a tensor shard holding " + ", ".join(tensors[:5]) + (" ..." if len(tensors) > 5 else "")
    return "a checkpoint file"


def check_file_checksums(path: Path, recorded: dict[str, dict[str, Any]] | None,
                         held: dict[str, set[str]] | None = None) -> None:
    """ValueError naming the first file whose size or CRC32 differs from what the save recorded;
    nothing when the checkpoint predates checksums (``recorded`` None)."""
    for name, want in sorted((recorded or {}).items()):
        f = path / name
        what = role(name, held)
        if not f.is_file():
            raise ValueError(f"{f} ({what}) is missing; the checkpoint is incomplete")
        size = f.stat().st_size
        if size != want.get("size"):
            raise ValueError(f"{f} ({what}) has {size} bytes, the save wrote {want.get('size')}: truncated or "
                             "overwritten")
        got = crc32_file(f)
        if got != want.get("crc32"):
            raise ValueError(f"{f} ({what}) is corrupt: CRC32 {got}, the save wrote {want.get('crc32')}")
