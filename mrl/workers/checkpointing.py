"""HF export of a Megatron role: gather every pipeline stage's TP-gathered tensors, write safetensors.

Each PP stage yields its own layers (``mrl.megatron.mapping.export_hf_weights``, TP-gathered); the
stages' tensors travel to global rank 0 (DP rank 0 of every stage sends, others only take part in
the TP gathers) which writes ``model.safetensors`` + ``config.json`` (+ tokenizer files copied from
the source checkpoint). Memory: rank 0 holds the whole model once on CPU — fine for the models the
CPU path trains; the conversion CLI (``mrl-ckpt``) streams for large ones.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

HF_SUBDIR = "huggingface"  # verl's get_hf_model_checkpoint_path: <ckpt>/global_step_N/actor/huggingface


def export_hf(model, out_dir: str | os.PathLike) -> None:
    """Collective: write an HF checkpoint of ``model``'s current weights to ``out_dir``."""
    from megatron.core import parallel_state as ps

    from mrl.megatron.hf_io import (
        carried_tensors,
        copy_hf_side_files,
        write_hf_checkpoint,
    )

    local = {n: t.detach().cpu().contiguous() for n, t in model.named_parameters_hf()}
    send = local if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0 else {}
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    # Object gather: tensors are pickled by torch's own reducer between our own ranks (trusted).
    dist.gather_object(send, gathered, dst=0)
    if dist.get_rank() == 0:
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part or {})
        out = Path(out_dir)
        # a vision-language checkpoint's vision tower (and MTP layers) go out unchanged: the export is complete
        write_hf_checkpoint(out, sorted(full.items()) + carried_tensors(model.hf_path, model.hf_config))
        copy_hf_side_files(model.hf_path, out)  # config.json, tokenizer, generation config
    dist.barrier()


def save_hf_side_files(model, out_dir: str | os.PathLike) -> None:
    """Collective: rank 0 copies ``model``'s config and tokenizer files (no weights) to ``out_dir``."""
    from mrl.megatron.hf_io import copy_hf_side_files

    if dist.get_rank() == 0:
        copy_hf_side_files(model.hf_path, out_dir)
    dist.barrier()
