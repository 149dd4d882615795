"""LoRA files next to an actor checkpoint and the PEFT export (``adapter_config.json`` +
``adapter_model.safetensors``, the layout ``peft.PeftModel.from_pretrained`` loads).

``<ckpt>/lora_config.json`` records rank, alpha, dropout, targets and the base model: with it
``mrl-ckpt`` rebuilds the adapters before loading the dist checkpoint (whose ``A``/``B`` tensors
are stored next to the frozen base weights), so ``mcore-to-hf`` writes merged weights and
``mcore-to-peft`` the adapter alone.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LORA_META = "lora_config.json"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def write_lora_meta(ckpt_dir: str | os.PathLike, lora: Any, base_model: str,
                    targets: tuple[str, ...] | None = None) -> None:
    """Rank 0 writes ``lora_config.json`` (plain JSON; no pickles) before the checkpoint's weights; ``targets``: the
    projections the model has of ``lora.targets`` (:func:`mrl.megatron.lora.adapted_targets`; None: all of them)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    targets = lora.targets if targets is None else targets
    meta = {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "targets": list(targets),
            "base_model": str(base_model)}
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(ckpt_dir) / (LORA_META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(Path(ckpt_dir) / LORA_META)


def read_lora_meta(ckpt_dir: str | os.PathLike) -> dict | None:
    """The checkpoint's LoRA settings, or None for a full-weight checkpoint."""
    path = Path(ckpt_dir) / LORA_META
    if not path.is_file():
        return None
    meta = json.loads(path.read_text())
    missing = {"rank", "alpha", "dropout", "targets"} - set(meta)
    if missing:
        raise ValueError(f"{path} lacks {sorted(missing)}; it was not written by mrl (or was edited)")
    return meta


def write_peft(out_dir: str | os.PathLike, tensors: dict, meta: dict, base_model: str | None = None) -> list[str]:
    """``adapter_model.safetensors`` (peft's tensor names) + ``adapter_config.json``."""
    from safetensors.torch import save_file

    from mrl.megatron.lora import peft_adapter_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / PEFT_WEIGHTS),
              metadata={"format": "pt"})
    cfg = peft_adapter_config(base_model or meta.get("base_model", ""), rank=meta["rank"], alpha=meta["alpha"],
                              dropout=meta["dropout"], targets=tuple(meta["targets"]))
    (out / PEFT_CONFIG).write_text(json.dumps(cfg, indent=2))
    return [PEFT_WEIGHTS, PEFT_CONFIG]


def check_lora_matches(ckpt_dir: str | os.PathLike, lora: Any, targets: tuple[str, ...] | None = None) -> None:
    """Refuse a resume whose adapters do not match ``actor.lora`` (before Megatron reports missing keys); ``targets``
    as for :func:`write_lora_meta`."""
    from mrl.megatron.checkpoint import CheckpointError

    targets = lora.targets if targets is None else targets

    meta = read_lora_meta(ckpt_dir)
    if meta is None and lora.enabled:
        raise CheckpointError(
            f"{ckpt_dir} was saved without LoRA but actor.lora.rank={lora.rank}; fix: actor.lora.rank=0 to resume "
            "it, or start the LoRA run from the HF model (model.path) instead of this checkpoint")
    if meta is not None:
        want = {"rank": lora.rank, "targets": list(targets)}
        have = {"rank": meta["rank"], "targets": list(meta["targets"])}
        if want != have or (lora.enabled and float(meta["alpha"]) != float(lora.alpha)):
            raise CheckpointError(
                f"{ckpt_dir} holds LoRA adapters rank={meta['rank']} alpha={meta['alpha']} targets={meta['targets']} "
                f"({LORA_META}) but actor.lora is rank={lora.rank} alpha={lora.alpha} targets={list(targets)}; "
                f"fix: set actor.lora.rank={meta['rank']} actor.lora.alpha={meta['alpha']} "
                f"actor.lora.target_modules=[{','.join(meta['targets'])}]")
