"""Per-rank bodies of the ``mrl-ckpt`` commands (run by :func:`checkpoints_tools.launch.run_local_ranks`).

Each body sets up Megatron's parallel state for the target layout, builds the model from the HF
config (:mod:`mrl.megatron.provider`), moves the weights with the HF↔Megatron table
(:mod:`mrl.megatron.mapping`) or ``dist_checkpointing`` (:mod:`mrl.megatron.checkpoint`), and
returns a small picklable summary. Module-level functions: ``spawn`` pickles them by name.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from checkpoints_tools.preflight import CheckpointInputError
from mrl.config.weights_fit import WEIGHTS_FIX
from mrl.dtypes import torch_dtype


def dtype_from_name(name: str) -> torch.dtype:
    """``fp32``/``bf16``/``fp16`` or their HF names (``mrl.dtypes``)."""
    return torch_dtype(name)


def _progress(iterable: Iterable, *, total: int | None, desc: str) -> Iterable:
    """A tqdm bar on global rank 0 only (other ranks iterate silently)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="tensor", file=sys.stderr, mininterval=0.5)


def _setup(device: str, tp: int, pp: int, vpp: int | None, timeout_s: int, ep: int = 1, etp: int | None = None) -> None:
    from mrl.megatron.parallel import init_parallel

    init_parallel(device=device, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, timeout_s=timeout_s)


def _build(cfg_dir: str, dtype: torch.dtype, lora_ckpt: str | None = None,
           uneven: dict[str, int] | None = None) -> tuple[Any, list]:
    from mrl.families import family_of
    from mrl.megatron.lora_io import LORA_META
    from mrl.megatron.provider import (
        build_model_chunks,
        load_hf_config,
        resolve_attention_backend,
    )

    cfg = load_hf_config(cfg_dir)
    lora = lora_ckpt is not None and (Path(lora_ckpt) / LORA_META).is_file()
    # the layer spec the trainer picks on this host (TE's parameter names differ from the local spec's)
    backend = resolve_attention_backend("auto", lora=lora, mla=family_of(cfg).is_mla)
    # uneven: Megatron's num_layers_in_first/last_pipeline_stage (mrl-ckpt's flags of those names)
    return cfg, build_model_chunks(cfg, dtype=dtype, attention_backend=backend, config_overrides=uneven)


def _maybe_lora(ckpt_dir: str, cfg: Any, chunks: list) -> dict | None:
    """Add the adapters a LoRA checkpoint holds (``lora_config.json``), so it loads and exports merged."""
    from mrl.megatron.lora import apply_lora
    from mrl.megatron.lora_io import read_lora_meta

    meta = read_lora_meta(ckpt_dir)
    if meta is not None:
        apply_lora(chunks, cfg, targets=tuple(meta["targets"]), rank=int(meta["rank"]), alpha=float(meta["alpha"]),
                   dropout=0.0, seed=0)
    return meta


def mcore_to_peft_rank(
    rank: int, ckpt_dir: str, cfg_dir: str, tp: int, pp: int, model_dtype: str, device: str, timeout_s: int,
) -> dict[str, Any]:
    """Load a LoRA dist checkpoint at (tp, pp); TP/DP rank 0 of each stage returns its full adapter tensors."""
    from megatron.core import parallel_state as ps

    from mrl.megatron.checkpoint import load_checkpoint
    from mrl.megatron.lora import export_peft_tensors
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    _setup(device, tp, pp, None, timeout_s)
    cfg = load_hf_config(cfg_dir)
    chunks = build_model_chunks(cfg, dtype=dtype_from_name(model_dtype), attention_backend="sdpa")  # LoRA: local spec
    if _maybe_lora(ckpt_dir, cfg, chunks) is None:
        raise ValueError(f"{ckpt_dir} has no lora_config.json: it is not a LoRA checkpoint (use mcore-to-hf)")
    load_checkpoint(ckpt_dir, chunks)
    tensors = {n: t.cpu().numpy() for n, t in export_peft_tensors(chunks)}  # collective over TP
    keep = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return tensors if keep else {}


def hf_to_mcore_rank(
    rank: int, hf_dir: str, out_dir: str, tp: int, pp: int, vpp: int | None, dtype: str,
    device: str, timeout_s: int, ep: int = 1, etp: int | None = None, uneven: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Read HF safetensors into a (tp, pp, vpp, ep, etp) model (``uneven``: its pipeline split) and save it with
    dist_checkpointing."""
    from mrl.megatron.checkpoint import save_checkpoint
    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import hf_names_for_stage, load_hf_weights

    _setup(device, tp, pp, vpp, timeout_s, ep, etp)
    cfg, chunks = _build(hf_dir, dtype_from_name(dtype), uneven=uneven)
    reader = HFCheckpointReader(hf_dir)
    names = hf_names_for_stage(chunks, cfg)
    missing = [n for n in names if n not in reader]
    if missing:
        raise CheckpointInputError(
            f"--hf {hf_dir}: tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} are missing from "
            f"{_weight_files(hf_dir)} ({len(reader.names())} tensors there), and its config.json "
            f"({_describe(cfg)}) needs them; fix: re-download or re-save the complete checkpoint, or put the "
            "config.json these weights were saved with next to them"
        )
    bar = iter(_progress(names, total=len(names), desc="hf -> mcore (stage of rank 0)"))
    read: list[tuple[str, tuple[int, ...]]] = []

    def get_tensor(name: str) -> torch.Tensor:
        next(bar, None)
        t = reader.get(name)
        read.append((name, tuple(t.shape)))
        return t

    try:
        load_hf_weights(chunks, cfg, get_tensor)
    except (ValueError, RuntimeError, IndexError) as e:  # every name is present: the shapes do not fit config.json
        raise CheckpointInputError(_shape_problem(hf_dir, cfg, read, e)) from e
    for _ in bar:  # finish the bar (tied weights are read twice, some names once)
        pass
    save_checkpoint(out_dir, chunks, hf_config=cfg)
    return {"rank": rank}


def _weight_files(hf_dir: str, names: list[str] | None = None) -> str:
    """The safetensors file(s) holding ``names`` (all of the checkpoint's without names), for a message."""
    from mrl.megatron.hf_io import INDEX_NAME, SINGLE_NAME

    index = Path(hf_dir) / INDEX_NAME
    if not index.is_file():
        return str(Path(hf_dir) / SINGLE_NAME)
    where = json.loads(index.read_text()).get("weight_map", {})
    files = sorted({where[n] for n in names if n in where}) if names else sorted(set(where.values()))
    return ", ".join(str(Path(hf_dir) / f) for f in files[:4]) + (" ..." if len(files) > 4 else "")


def _describe(cfg: Any) -> str:
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    return (f"{arch}, {getattr(cfg, 'num_hidden_layers', '?')} layers, hidden {getattr(cfg, 'hidden_size', '?')}, "
            f"{getattr(cfg, 'num_attention_heads', '?')} heads")


def _culprits(cfg: Any, last: str) -> list[str]:
    """The HF tensors of the one Megatron parameter whose conversion read ``last`` last (q/k/v, gate/up or one):
    the mapping table's rule that names ``last``, formatted with its layer/expert index."""
    import re

    from mrl.megatron.mapping import FAMILY_TABLES
    from mrl.megatron.provider import model_family

    for rule in FAMILY_TABLES.get(model_family(cfg), ()):
        for pattern in rule.hf:
            regex = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)")
            if (m := re.fullmatch(regex, last)) is not None:
                return [p.format(**m.groupdict()) for p in rule.hf]
    return [last]


def _shape_problem(hf_dir: str, cfg: Any, read: list[tuple[str, tuple[int, ...]]], e: Exception) -> str:
    """One sentence for a tensor whose shape does not fit config.json: the tensors of the parameter whose
    conversion failed (read just before it is filled), their shapes and file, and what went wrong."""
    shapes = dict(read)
    last = [n for n in _culprits(cfg, read[-1][0]) if n in shapes] if read else []
    text = str(e).removesuffix(": config.json does not match the weights")
    detail = text if text.startswith("HF tensor") else f"{type(e).__name__}: {text}"
    return (f"--hf {hf_dir}: the weights do not fit config.json ({_describe(cfg)}): tensor(s) "
            f"{', '.join(f'{n} {list(shapes[n])}' for n in last)} in {_weight_files(hf_dir, last)} ({detail}); "
            f"{WEIGHTS_FIX}")


def mcore_to_hf_rank(
    rank: int, ckpt_dir: str, cfg_dir: str, out_dir: str, tp: int, pp: int, model_dtype: str,
    out_dtype: str, device: str, timeout_s: int, ep: int = 1, etp: int | None = None,
    uneven: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Load a dist checkpoint at (tp, pp) and write this pipeline stage's HF tensors.

    Stage s writes ``out_dir/stage-<s>/`` (TP and DP rank 0 only); the parent merges the stages.
    """
    from megatron.core import parallel_state as ps

    from mrl.megatron.checkpoint import load_checkpoint
    from mrl.megatron.hf_io import write_hf_checkpoint
    from mrl.megatron.mapping import export_hf_weights, hf_names_for_stage

    _setup(device, tp, pp, None, timeout_s, ep, etp)
    cfg, chunks = _build(cfg_dir, dtype_from_name(model_dtype), lora_ckpt=ckpt_dir, uneven=uneven)
    _maybe_lora(ckpt_dir, cfg, chunks)  # a LoRA checkpoint exports merged weights W + (alpha/r)·B·A
    load_checkpoint(ckpt_dir, chunks)
    total = len(hf_names_for_stage(chunks, cfg))
    stream: Iterator = iter(_progress(export_hf_weights(chunks, cfg), total=total, desc="mcore -> hf"))
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    stage_dir = Path(out_dir) / f"stage-{ps.get_pipeline_model_parallel_rank():05d}"
    if writer:
        files = write_hf_checkpoint(stage_dir, stream, dtype=dtype_from_name(out_dtype))
        return {"stage": ps.get_pipeline_model_parallel_rank(), "dir": str(stage_dir), "files": files}
    for _ in stream:  # non-writers still take part in the TP gathers
        pass
    return {}


def reshard_rank(
    rank: int, in_dir: str, cfg_dir: str, out_dir: str, tp: int, pp: int, vpp: int | None,
    model_dtype: str, device: str, timeout_s: int, ep: int = 1, etp: int | None = None,
    uneven: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Load a dist checkpoint into a (tp, pp, vpp, ep, etp) model (``uneven``: its pipeline split) and save it
    again (weights only)."""
    from mrl.megatron.checkpoint import load_checkpoint, save_checkpoint

    _setup(device, tp, pp, vpp, timeout_s, ep, etp)
    cfg, chunks = _build(cfg_dir, dtype_from_name(model_dtype), lora_ckpt=in_dir, uneven=uneven)
    _maybe_lora(in_dir, cfg, chunks)
    extra = load_checkpoint(in_dir, chunks)
    save_checkpoint(out_dir, chunks, hf_config=cfg, extra=extra)
    return {"rank": rank}


def merge_stage_dirs(out_dir: Path, stage_results: list[dict[str, Any]]) -> list[str]:
    """Move per-stage safetensors into ``out_dir`` as one HF checkpoint (index when > 1 file)."""
    import shutil

    from safetensors import safe_open

    from mrl.megatron.hf_io import INDEX_NAME, SINGLE_NAME

    stages = sorted((r for r in stage_results if r), key=lambda r: r["stage"])
    shard_files = [Path(r["dir"]) / f for r in stages for f in r["files"] if f.endswith(".safetensors")]
    if len(shard_files) == 1:
        shutil.move(str(shard_files[0]), out_dir / SINGLE_NAME)
        names = [SINGLE_NAME]
    else:
        weight_map: dict[str, str] = {}
        total = 0
        names = []
        for k, f in enumerate(shard_files):
            name = f"model-{k + 1:05d}-of-{len(shard_files):05d}.safetensors"
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():  # noqa: SIM118 - safe_open is not iterable
                    if key in weight_map:
                        raise RuntimeError(f"tensor {key!r} was written by two pipeline stages")
                    weight_map[key] = name
                    sl = sf.get_slice(key)
                    total += _numel(sl.get_shape()) * _itemsize(sl.get_dtype())
            shutil.move(str(f), out_dir / name)
            names.append(name)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
        names.append(INDEX_NAME)
    for r in stages:
        shutil.rmtree(r["dir"], ignore_errors=True)
    return names


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(st_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}.get(st_dtype, 1)


def hf_param_count(hf_dir: str | Path) -> int:
    """Number of scalars in an HF safetensors checkpoint (header read only)."""
    from safetensors import safe_open

    from mrl.megatron.hf_io import INDEX_NAME, SINGLE_NAME

    index = Path(hf_dir) / INDEX_NAME
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file() else [SINGLE_NAME]
    )
    n = 0
    for f in files:
        with safe_open(str(Path(hf_dir) / f), framework="pt") as sf:
            n += sum(_numel(sf.get_slice(k).get_shape()) for k in sf.keys())  # noqa: SIM118 - safe_open is not iterable
    return n

