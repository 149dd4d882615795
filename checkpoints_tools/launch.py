"""Run one conversion function on N local ranks (gloo on CPU, NCCL on GPUs) with a deadline.

``mrl-ckpt`` starts its own ranks so that a user runs one command; the launcher is mrl's one
local-rank launcher (:mod:`mrl.local_ranks`: spawn, own process groups, first failure stops all). On CPU
the ranks are forks of one server that imported torch and Megatron once (``preload``): a 4-rank conversion
on a 2-core host paid those imports (~3 s) four times over before.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from mrl.local_ranks import RankError
from mrl.local_ranks import run_local_ranks as _run

__all__ = ["RankError", "pick_device", "run_local_ranks"]

# CPU only: none of these touches CUDA or starts a thread on import (a forked rank would inherit either);
# on GPUs the ranks stay fresh spawned processes.
CPU_PRELOAD = ("torch", "torch.distributed", "mrl.megatron", "megatron.core", "megatron.core.models.gpt",
               "megatron.core.dist_checkpointing", "checkpoints_tools.convert")


def pick_device(requested: str, world_size: int) -> str:
    """``auto`` → ``cuda`` when at least ``world_size`` GPUs are visible, else ``cpu``."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus < world_size:
        raise ValueError(
            f"--device cuda needs {world_size} GPUs (tp*pp) but {gpus} are visible; "
            "use --device cpu or fewer ranks"
        )
    return "cuda" if gpus >= world_size else "cpu"


def run_local_ranks(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any], *, device: str, timeout_s: float
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks; results by rank, or :class:`RankError`."""
    threads = max(1, (os.cpu_count() or 1) // world_size) if device == "cpu" else None
    return _run(fn, world_size, args, timeout_s=timeout_s, threads_per_rank=threads,
                timeout_hint="; raise --timeout for large models", preload=CPU_PRELOAD if device == "cpu" else ())
