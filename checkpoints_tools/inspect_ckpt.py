"""Read a Megatron dist checkpoint in one process (no process group) and summarise it.

Model tensors are stored by ``dist_checkpointing`` under global keys with global shapes, so the
torch DCP reader can assemble every full tensor without knowing the layout that wrote it. Used by
``mrl-ckpt inspect`` and by tests comparing checkpoints written at different layouts.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def iter_full_tensors(
    ckpt_dir: str | Path, keep: Callable[[str], bool] = lambda k: not k.startswith("optimizer")
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, full tensor)`` for the stored tensors whose key passes ``keep`` (sorted)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from mrl.megatron.checkpoint import verify_checkpoint

    verify_checkpoint(ckpt_dir)
    reader = FileSystemReader(str(ckpt_dir))
    meta = reader.read_metadata()
    for key in sorted(meta.state_dict_metadata):
        md = meta.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata) or not keep(key):
            continue
        # One tensor at a time keeps memory at the size of the largest tensor.
        sd = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)}
        dcp.load(sd, storage_reader=FileSystemReader(str(ckpt_dir)), no_dist=True)
        yield key, sd[key]


def tensor_digest(t: torch.Tensor) -> str:
    """First 16 hex digits of sha256 over the tensor's bytes (dtype-exact fingerprint)."""
    raw = t.detach().contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16]


def inspect_checkpoint(ckpt_dir: str | Path, *, checksums: bool = True) -> str:
    """Human-readable summary: layout, dtype, parameter count, per-tensor shape and checksum."""
    from mrl.megatron.checkpoint import verify_checkpoint

    info = verify_checkpoint(ckpt_dir)
    meta = info["metadata"]
    lay = meta.get("layout", {})
    model_keys = {k: s for k, s in info["tensors"].items() if not k.startswith("optimizer")}
    n_params = sum(_numel(s) for s in model_keys.values())
    hf = meta.get("hf_config") or {}
    lines = [
        f"checkpoint     {Path(ckpt_dir).resolve()}",
        (f"format         {meta.get('format')}  (mrl {meta.get('mrl_version')}, megatron-core "
        f"{meta.get('megatron_core_version')}, torch {meta.get('torch_version')})"),
        (f"saved layout   tp={lay.get('tp')} pp={lay.get('pp')} vpp={lay.get('vpp')} "
         + "".join(f"{k}={lay[k]} " for k in ("num_layers_in_first_pipeline_stage",
                                              "num_layers_in_last_pipeline_stage") if k in lay)
         + f"dp={lay.get('dp')} world={lay.get('world_size')}  (loads at any layout)"),
        (f"model          {hf.get('architectures')} vocab={hf.get('vocab_size')} "
        f"layers={hf.get('num_hidden_layers')} hidden={hf.get('hidden_size')}"),
        f"params dtype   {meta.get('params_dtype')}",
        f"parameters     {n_params:,} stored (vocab rows padded to the saving TP)",
        f"optimizer      {'yes (' + str(meta.get('optim_sharding')) + ')' if meta.get('has_optimizer') else 'no'}",
        f"tensors        {len(model_keys)} model tensors",
    ]
    if checksums:
        lines.append(f"{'key':60s} {'shape':>22s} {'dtype':>9s} {'sum':>14s} {'sha256[:16]':>17s}")
        for key, t in iter_full_tensors(ckpt_dir):
            lines.append(
                f"{key:60s} {tuple(t.shape)!s:>22s} {str(t.dtype).replace('torch.', ''):>9s} "
                f"{t.double().sum().item():>14.6g} {tensor_digest(t):>17s}"
            )
    return "\n".join(lines)


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
