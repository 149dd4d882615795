"""Layout-independent Megatron checkpoints: model (+ optimizer, scheduler) through ``dist_checkpointing``.

A checkpoint directory holds Megatron-Core's ``torch_dist`` format (``metadata.json``, ``common.pt``,
``__R_I.distcp`` shard files, ``.metadata``) plus ``mrl_checkpoint.json`` (HF config, parallel
layout, versions). Tensors are stored under global keys with global shapes (Megatron's
``sharded_state_dict``: layers stacked as ``decoder.layers.<name>`` of shape ``[L, ...]``, TP
shards as slices of the full tensor), so a checkpoint saved at TP2×PP2(×VPP) loads at any other
TP/PP/VPP/DP. The vocab-padded embedding/output rows carry ``allow_shape_mismatch`` in Megatron,
so a different ``make_vocab_size_divisible_by × TP`` padding loads too (extra rows are zeros).

``mrl_checkpoint.json`` is written last by rank 0, after every rank finished writing: its presence
marks a complete checkpoint. Everything non-tensor (``extra``, scheduler, optimizer param groups)
goes through ``common.pt``, which Megatron reads with ``torch.load(weights_only=True)``: keep
``extra`` to plain Python types (int, float, str, bool, lists/dicts of them, tensors).

Optimizer state uses the DistributedOptimizer's ``fully_reshardable`` format by default: each
data-parallel group gathers its optimizer state on DP rank 0 into per-parameter tensors (like the
weights), so it reshards across TP/PP/DP. ``dp_reshardable`` writes the flat DP buffers as they are
(no gather, faster) but loads only at the same TP/PP. The format is recorded and reused on load.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mrl.megatron.checkpoint_checksums import check_file_checksums, file_checksums

logger = logging.getLogger(__name__)

METADATA_FILE = "mrl_checkpoint.json"
FORMAT = "mrl-mcore-torch_dist-v1"
DEFAULT_OPTIM_SHARDING = "fully_reshardable"
# megatron-core 0.16 rejects the flattened ShardedTensors that "fully_sharded_model_space" needs.
_OPTIM_SHARDINGS = ("fully_reshardable", "dp_reshardable")


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, incomplete, corrupt or does not match the model."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def parallel_layout() -> dict[str, int | None]:
    """The Megatron parallel sizes of this process (``parallel_state`` must be initialised)."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }


def _pipeline_split(model_chunks: Sequence[torch.nn.Module]) -> dict[str, int]:
    """The uneven pipeline split the model was built with (Megatron's num_layers_in_first/last_pipeline_stage),
    only the sizes that are set: informational (the checkpoint loads at any split)."""
    from mrl.megatron.unwrap import unwrap

    cfg = unwrap(model_chunks[0]).config
    # Megatron's field names, spelled here: mrl.megatron does not import mrl.config (tests/test_import_contract.py)
    return {k: v for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
            if (v := getattr(cfg, k, None)) is not None}


def _sd_metadata(optim_sharding: str) -> dict[str, Any]:
    """Options steering every ``sharded_state_dict`` call (Megatron-LM passes the same keys)."""
    if optim_sharding not in _OPTIM_SHARDINGS:
        raise CheckpointError(
            f"optim_sharding={optim_sharding!r} is not supported; use one of {_OPTIM_SHARDINGS}"
        )
    return {
        "singleton_local_shards": False,
        "distrib_optim_sharding_type": optim_sharding,
        "chained_optim_avoid_prefix": True,
    }


def _unwrap(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The GPTModels inside DDP / Float16Module wrappers.

    Megatron's DDP has no ``sharded_state_dict`` of its own: the generic one would store every key
    under a ``module.`` prefix, tying the checkpoint to the wrapping. Parameters are the same
    tensors, so the optimizer still finds them by identity.
    """
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model_chunks))


def _model_sharded_state_dict(model_chunks: Sequence[torch.nn.Module], md: dict) -> dict[str, Any]:
    model_chunks = _unwrap(model_chunks)
    # ``dict(md)``: Megatron adds a process group (dp_cp_group) to the dict it is given, which
    # must not leak into the checkpoint's content metadata.
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict(metadata=dict(md))}
    # Virtual pipeline chunks: the dict keys are only containers; tensors are stored under their
    # global ShardedTensor keys, so chunk count does not leak into the checkpoint.
    return {f"model{i}": c.sharded_state_dict(metadata=dict(md)) for i, c in enumerate(model_chunks)}


def _hf_config_dict(hf_config: Any) -> dict | None:
    if hf_config is None:
        return None
    if isinstance(hf_config, dict):
        return hf_config
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise CheckpointError(f"hf_config must be a transformers config or a dict, got {type(hf_config)}")


def _in_process_write_results() -> None:
    """Give Megatron's torch_dist writer an in-process queue for its write results.

    On a rank's first save, ``FileSystemWriterAsync`` makes that queue with
    ``multiprocessing.get_context("spawn").Manager()``: a server in a new interpreter, which
    re-imports the rank's main module (a Ray worker's: Ray and what it pulls in). Measured on the
    project's 2-core host (2026-11-28): 2.1-2.4 CPU-s per rank, ~15 % of a 1-step PPO run's CPU.
    A process-shared queue is only needed when the writing runs in another process (Megatron's
    async save); mrl saves synchronously: ``execute_sync`` runs the writer in the rank itself, its
    per-file writers are forks that report through a queue of their own, and the rank puts the
    collected result into this one and reads it back in ``retrieve_write_results``.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # a megatron-core that moved this private global gets no queue here and starts its Manager, as before
    # (slower, not wrong); tests/megatron/test_checkpoint.py counts the Managers and fails then
    if getattr(filesystem_async, "_results_queue", queue.Queue) is None:
        filesystem_async._results_queue = queue.Queue()


def _save_strategy(fully_parallel: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    strategy = get_default_save_sharded_strategy("torch_dist")
    if fully_parallel and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        # Data-parallel replicas split the writing of replicated tensors instead of DP rank 0
        # writing everything.
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, ps.get_data_parallel_group(with_context_parallel=True)
        )
    return strategy


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    extra: dict | None = None,
    *,
    hf_config: Any = None,
    optim_sharding: str = DEFAULT_OPTIM_SHARDING,
    fully_parallel: bool = True,
) -> Path:
    """Collectively save ``model_chunks`` (and optimizer/scheduler state) to ``ckpt_dir``.

    Every rank of the job calls this with its own chunks (GPTModel, DDP or Float16Module wrapped;
    one per virtual pipeline stage). ``extra`` (plain types; rank 0's copy is stored, so pass the
    same on every rank) comes back from :func:`load_checkpoint`. ``hf_config`` (transformers config or dict) is recorded in
    ``mrl_checkpoint.json`` so that conversion back to HF needs no other input.
    Returns the checkpoint path.
    """
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir)
    path.mkdir(parents=True, exist_ok=True)
    if _rank() == 0 and (path / METADATA_FILE).exists():
        # Remove the completion marker first: an interrupted overwrite must not look complete.
        (path / METADATA_FILE).unlink()
    _barrier()

    md = _sd_metadata(optim_sharding)
    state = _model_sharded_state_dict(model_chunks, md)
    if optimizer is not None:
        # A never-stepped optimizer (the actor during trainer.critic_warmup) trips the same
        # megatron-core assert as on load; its zero state is exactly what Adam would start from.
        _prime_torch_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=dict(md))
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    state["mrl_extra"] = dict(extra or {})

    _in_process_write_results()  # synchronous save: no spawned Manager process per rank
    dist_checkpointing.save(
        state, str(path), sharded_strategy=_save_strategy(fully_parallel), content_metadata=md
    )
    _barrier()
    if _rank() == 0:
        import megatron.core

        try:
            from importlib.metadata import version

            mrl_version = version("mrl")
        except Exception:  # noqa: BLE001 - running from a source tree without install
            mrl_version = "unknown"
        dtypes = sorted({str(p.dtype).replace("torch.", "") for c in model_chunks for p in c.parameters()})
        meta = {
            "format": FORMAT,
            "mrl_version": mrl_version,
            "megatron_core_version": megatron.core.__version__,
            "torch_version": torch.__version__,
            "created_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "layout": {**parallel_layout(), **_pipeline_split(model_chunks)},
            "params_dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
            "has_optimizer": optimizer is not None,
            "has_scheduler": opt_param_scheduler is not None,
            "optim_sharding": optim_sharding if optimizer is not None else None,
            "hf_config": _hf_config_dict(hf_config),
            # every file is whole on disk now (the barrier above): verify_checkpoint compares them
            "files": file_checksums(path, skip=(METADATA_FILE, METADATA_FILE + ".tmp")),
        }
        tmp = path / (METADATA_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str))
        tmp.replace(path / METADATA_FILE)
    _barrier()
    return path


def read_checkpoint_metadata(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """Return ``mrl_checkpoint.json`` of a checkpoint; a clear error when it is not one."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    meta_file = path / METADATA_FILE
    if not meta_file.exists():
        hint = (
            "it holds a Hugging Face checkpoint; convert it with `mrl-ckpt hf-to-mcore`"
            if (path / "config.json").exists() and any(path.glob("*.safetensors"))
            else "the save did not finish (re-run it) or this is not an mrl checkpoint"
        )
        raise CheckpointError(f"{meta_file} is missing: {hint}")
    try:
        return json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_file} is not valid JSON ({e}); the checkpoint is corrupt") from e


def verify_checkpoint(ckpt_dir: str | os.PathLike, *, checksums: bool = True) -> dict[str, Any]:
    """Check that every shard file the checkpoint index refers to exists and is long enough, and (``checksums``)
    that every file's CRC32 is the one the save recorded (mrl/megatron/checkpoint_checksums.py).

    Returns ``{"metadata": ..., "tensors": {key: global_shape}}``. Raises :class:`CheckpointError`
    naming the missing/truncated file and the tensors stored in it.
    """
    from mrl.megatron import safe_metadata

    # Every later DCP read in this process (Megatron's loader, mrl-ckpt) goes through the
    # restricted unpickler too: `.metadata` is user-writable data, never arbitrary pickle.
    safe_metadata.install()
    path = Path(ckpt_dir)
    meta = read_checkpoint_metadata(path)
    for name in ("metadata.json", "common.pt", ".metadata"):
        if not (path / name).exists():
            raise CheckpointError(f"{path / name} is missing: the checkpoint is incomplete; re-save it")
    if checksums and meta.get("files", {}).get(".metadata"):
        try:  # before the index is parsed: a corrupt one is named as such, not as a parser error
            check_file_checksums(path, {".metadata": meta["files"][".metadata"]})
        except ValueError as e:
            raise CheckpointError(f"{e}; do not resume from it (an earlier checkpoint, or re-save)") from None
    try:
        dcp_meta = safe_metadata.load_dcp_metadata(path)
    except safe_metadata.UnsafeCheckpointMetadata as e:
        raise CheckpointError(
            f"refusing the tensor index {path / '.metadata'}: it {e}; it was not written by torch "
            "distributed checkpointing (possibly tampered with): do not load this directory"
        ) from e
    except Exception as e:
        raise CheckpointError(f"cannot read the tensor index {path / '.metadata'}: {e}") from e
    needed: dict[str, int] = {}
    held: dict[str, set[str]] = {}
    for idx, info in dcp_meta.storage_data.items():
        rel = info.relative_path
        needed[rel] = max(needed.get(rel, 0), info.offset + info.length)
        held.setdefault(rel, set()).add(idx.fqn)
    for rel, size in sorted(needed.items()):
        f = path / rel
        tensors = ", ".join(sorted(held[rel])[:5]) + (" ..." if len(held[rel]) > 5 else "")
        if not f.exists():
            raise CheckpointError(f"shard file {f} is missing (it holds {tensors}); re-save the checkpoint")
        if f.stat().st_size < size:
            raise CheckpointError(
                f"shard file {f} is truncated ({f.stat().st_size} < {size} bytes; holds {tensors})"
            )
    if checksums:
        try:
            check_file_checksums(path, meta.get("files"), held)
        except ValueError as e:
            raise CheckpointError(f"{e}; do not resume from it (an earlier checkpoint, or re-save)") from None
    shapes = {
        k: tuple(v.size) for k, v in dcp_meta.state_dict_metadata.items() if hasattr(v, "size")
    }
    return {"metadata": meta, "tensors": shapes}


def _check_keys(sharded_sd: dict, stored: dict[str, tuple]) -> None:
    """Fail before reading data if a requested tensor is absent or has another global shape."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    missing, wrong = [], []
    for sh in nested_values(sharded_sd):
        if not isinstance(sh, ShardedTensor):
            continue
        if sh.key not in stored:
            missing.append(sh.key)
        elif not sh.allow_shape_mismatch and tuple(stored[sh.key]) != tuple(sh.global_shape):
            wrong.append(f"{sh.key}: checkpoint {tuple(stored[sh.key])} vs model {tuple(sh.global_shape)}")
    if missing:
        raise CheckpointError(
            f"checkpoint lacks tensor(s) {sorted(set(missing))[:8]}"
            f"{' ...' if len(set(missing)) > 8 else ''}: it was saved from another model "
            "architecture or is corrupt"
        )
    if wrong:
        raise CheckpointError(
            "tensor shapes differ between checkpoint and model (different model config?): "
            + "; ".join(sorted(set(wrong))[:8])
        )


def _prime_torch_adam_state(optimizer: Any) -> None:
    """Give a never-stepped torch Adam a zero state (``step=0``, zero moments) before loading.

    Without Apex/Transformer Engine, megatron-core 0.16's ``DistributedOptimizer.state_dict()``
    (called while building the sharded state dict to load into) reads ``step`` from every
    parameter's Adam state and asserts there is exactly one value, so a fresh optimizer cannot be
    loaded into. A zero state is what Adam starts from; the load then overwrites it.
    """
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if "step" not in st:
                    st.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                    st.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
                    st["step"] = torch.tensor(0.0)


@contextlib.contextmanager
def _torch_adam_step_aside(optimizer: Any) -> Iterator[None]:
    """Work around two megatron-core 0.16 bugs of the DistributedOptimizer with torch Adam.

    Without Apex/TE: (1) the fully_reshardable loader skips ``step`` in the loaded per-parameter
    tensors but copies into every key of the live state, ``step`` included (KeyError); ``step`` is
    restored from the param groups by ``load_state_dict`` before, so setting it aside is exact.
    (2) see the comment at the end.
    """
    from megatron.core.optimizer import distrib_optimizer as do

    patched = []
    if not do.HAVE_APEX_OR_TE:
        for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            if not isinstance(opt, do.DistributedOptimizer):
                continue
            orig = opt.load_parameter_state_from_fully_reshardable

            def load_without_step(param_state: Any, _opt: Any = opt, _orig: Any = orig) -> None:
                states = _opt.optimizer.state.values()
                steps = [st.pop("step", None) for st in states]
                try:
                    _orig(param_state)
                finally:
                    for st, step in zip(states, steps, strict=True):
                        if step is not None:
                            st["step"] = step

            opt.load_parameter_state_from_fully_reshardable = load_without_step
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.load_parameter_state_from_fully_reshardable  # back to the class method
    if not do.HAVE_APEX_OR_TE:
        # The same loader puts ONE ``step`` tensor into every parameter's state; torch Adam
        # increments it in place per parameter, which would corrupt the bias correction.
        for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
            for st in getattr(getattr(opt, "optimizer", None), "state", {}).values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any = None,
    opt_param_scheduler: Any = None,
    *,
    load_optimizer: bool = True,
    fully_parallel: bool = True,
) -> dict[str, Any]:
    """Collectively load a checkpoint into ``model_chunks`` (any TP/PP/VPP/DP layout).

    With ``optimizer`` given and ``load_optimizer=True`` the optimizer state is loaded too (the
    checkpoint must have one); with ``load_optimizer=False`` only the weights are loaded and the
    optimizer's main (fp32) parameters are refreshed from them. Returns the ``extra`` dict given
    to :func:`save_checkpoint`.
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    path = Path(ckpt_dir)
    info = verify_checkpoint(path)
    meta = info["metadata"]
    want_optim = optimizer is not None and load_optimizer
    if want_optim and not meta.get("has_optimizer"):
        raise CheckpointError(
            f"{path} holds no optimizer state; pass load_optimizer=False to load the weights only"
        )
    saved_md = dist_checkpointing.load_content_metadata(str(path)) or {}
    md = _sd_metadata(saved_md.get("distrib_optim_sharding_type", DEFAULT_OPTIM_SHARDING))

    state = _model_sharded_state_dict(model_chunks, md)
    if want_optim:
        _prime_torch_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=dict(md))
    _check_keys(state, info["tensors"])

    strategy = get_default_load_sharded_strategy(str(path))
    if fully_parallel and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, ps.get_data_parallel_group(with_context_parallel=True)
        )
    loaded = dist_checkpointing.load(state, str(path), sharded_strategy=strategy)

    if len(model_chunks) == 1:
        _unwrap(model_chunks)[0].load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(_unwrap(model_chunks)):
            chunk.load_state_dict(loaded[f"model{i}"], strict=True)
    if want_optim:
        with _torch_adam_step_aside(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        # The optimizer keeps its own fp32 main copies of bf16/fp16 weights: refresh them.
        optimizer.reload_model_params()
    if opt_param_scheduler is not None and load_optimizer:
        if "opt_param_scheduler" not in loaded:
            raise CheckpointError(f"{path} holds no opt_param_scheduler state; pass load_optimizer=False")
        opt_param_scheduler.load_state_dict(loaded["opt_param_scheduler"])
    _barrier()
    return dict(loaded.get("mrl_extra", {}))
