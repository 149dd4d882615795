"""Read and write Hugging Face safetensors checkpoints tensor by tensor.

Reading is lazy: ``safetensors.safe_open`` memory-maps each shard and materialises only the
tensors asked for, so a pipeline stage loads just its layers. Writing streams ``(name, tensor)``
pairs into shards of at most ``max_shard_bytes`` and writes ``model.safetensors.index.json``
when there is more than one shard (the layout ``transformers`` expects).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "added_tokens.json",
    # a vision-language checkpoint's processors (docs/vision.md): the engine and the data layer read them
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
)


class HFCheckpointReader:
    """Lazy name → tensor access to an HF safetensors directory (single file or index)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = self.path / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object; re-save the checkpoint")
            self._where = dict(weight_map)
        elif (self.path / SINGLE_NAME).is_file():
            from safetensors import safe_open

            with safe_open(str(self.path / SINGLE_NAME), framework="pt") as f:
                self._where = {k: SINGLE_NAME for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
        else:
            raise FileNotFoundError(
                f"{self.path} holds neither {SINGLE_NAME} nor {INDEX_NAME}; point to a Hugging Face "
                "checkpoint saved with safe_serialization=True (.bin checkpoints are not read, "
                "they would need unpickling)"
            )
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        """The full tensor ``name`` (a copy owned by the caller)."""
        from safetensors import safe_open

        shard = self._where.get(name)
        if shard is None:
            raise KeyError(
                f"tensor {name!r} is missing from the checkpoint at {self.path} (it has "
                f"{len(self._where)} tensors); the checkpoint is incomplete or of another architecture"
            )
        if shard not in self._handles:
            file = self.path / shard
            if not file.is_file():
                raise FileNotFoundError(f"{file} (listed in {INDEX_NAME} for {name!r}) does not exist")
            self._handles[shard] = safe_open(str(file), framework="pt")
        return self._handles[shard].get_tensor(name)  # type: ignore[attr-defined]

    __call__ = get


def write_hf_checkpoint(
    out_dir: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = 2 * 1024**3,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Stream ``tensors`` into safetensors shards under ``out_dir``; returns the file names.

    One shard → ``model.safetensors``; several → ``model-0000k-of-0000N.safetensors`` plus the
    index. Duplicate names are an error (they would silently shadow each other).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[str, list[str]]] = []
    buf: dict[str, torch.Tensor] = {}
    size = total = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal buf, size
        if buf:
            tmp = f"part-{len(parts):05d}.safetensors.tmp"
            save_file(buf, str(out / tmp), metadata={"format": "pt"})
            parts.append((tmp, list(buf)))
            buf, size = {}, 0

    for name, t in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} was produced twice while writing {out}")
        seen.add(name)
        t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if buf and size + nbytes > max_shard_bytes:
            flush()
        buf[name] = t
        size += nbytes
        total += nbytes
    flush()
    if not parts:
        raise ValueError(f"no tensors to write to {out}")
    if len(parts) == 1:
        os.replace(out / parts[0][0], out / SINGLE_NAME)
        return [SINGLE_NAME]
    files, weight_map = [], {}
    for k, (tmp, names) in enumerate(parts):
        final = f"model-{k + 1:05d}-of-{len(parts):05d}.safetensors"
        os.replace(out / tmp, out / final)
        files.append(final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    return files + [INDEX_NAME]


CARRIED_NAME = "carried.safetensors"
"""Where a Megatron checkpoint written by ``mrl-ckpt hf-to-mcore`` keeps the HF tensors mrl does not train (a
vision-language checkpoint's vision tower, its multi-token-prediction layers: ``Family.wrapped``), for the export."""


def carried_names(names: Iterable[str], hf_config) -> list[str]:
    """The checkpoint tensors under the family's ``wrapped`` prefixes (none for a plain decoder)."""
    from mrl.families import family_of

    prefixes = family_of(hf_config).wrapped
    return sorted(n for n in names if prefixes and n.startswith(prefixes))


def carried_tensors(src_dir: str | os.PathLike, hf_config) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every carried tensor of the HF checkpoint — or the Megatron checkpoint's
    :data:`CARRIED_NAME` — at ``src_dir``, to write next to the decoder's exported tensors unchanged."""
    src = Path(src_dir)
    if (src / CARRIED_NAME).is_file():
        from safetensors.torch import load_file

        return sorted(load_file(str(src / CARRIED_NAME)).items())
    if not ((src / INDEX_NAME).is_file() or (src / SINGLE_NAME).is_file()):
        return []
    reader = HFCheckpointReader(src)
    return [(n, reader.get(n)) for n in carried_names(reader.names(), hf_config)]


def copy_hf_side_files(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy config and tokenizer files that exist in ``src_dir`` (not the weights)."""
    copied = []
    for name in SIDE_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, Path(out_dir) / name)
            copied.append(name)
    return copied
