"""One rank of a separate teacher (``teacher.placement=separate``; docs/distillation.md, "Placement").

Constructed inside a rank actor of the teacher's own ``mrl.cluster.WorkerGroup``: its own torch.distributed
world and Megatron layout (``teacher.megatron``, null = the actor's sizes), as a separate reward model has
(:mod:`mrl.workers.rm_rank`). Every method is called on all ranks with the same full batch and returns the
same result.
"""
from __future__ import annotations

import os

import torch

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan
from mrl.dtypes import torch_dtype
from mrl.observability.fallbacks import collect_fallbacks, fallbacks_in_use
from mrl.workers.batch import TrainBatch

collect_fallbacks()  # before Megatron is imported: the driver prints its fallbacks once


class TeacherRank:
    """The frozen teacher of this rank, in its own distributed world (``init_parallel`` from the group's env)."""

    def before_call(self) -> None:
        """Megatron's CPU redirect is per thread: entered on the thread of each call (as ``TrainRank``)."""
        if os.environ.get("MRL_DEVICE") == "cpu":
            from mrl.megatron.cpu_support import enable_cpu_support

            enable_cpu_support()

    def __init__(self, cfg: MRLConfig, plan: RunPlan) -> None:
        from mrl.workers.teacher import TeacherWorker

        torch.set_num_threads(int(os.environ.get("MRL_TORCH_THREADS", "1")))
        t = cfg.teacher
        self.teacher = TeacherWorker(t.path, plan.layout["teacher"].parallel, micro_batch_size=t.micro_batch_size_per_gpu,
                                     temperature=cfg.rollout.temperature, device=plan.device, seed=cfg.trainer.seed,
                                     dtype=torch_dtype(plan.dtype), logits_chunk_size=cfg.actor.logits_chunk_size,
                                     shared_prefix=plan.shared_prefix, remove_padding=plan.remove_padding)

    def compute_teacher_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        """[B, R] teacher log-probs of the full batch (the worker splits it over this group's DP ranks)."""
        return self.teacher.compute_teacher_log_prob(batch)

    def fallbacks(self) -> list[str]:
        return fallbacks_in_use()

    def close(self) -> None:
        from mrl.megatron.parallel import destroy_parallel

        destroy_parallel()
