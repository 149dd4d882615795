"""One rank of a separate reward model (``reward_model.placement=separate``; docs/reward_model.md, "Placement").

Constructed inside a rank actor of the RM's own ``mrl.cluster.WorkerGroup``, whose RANK/WORLD_SIZE/
MASTER_PORT are that group's (rank 0's free port): the RM forms a torch.distributed world of its own
(gloo on CPU, NCCL on CUDA) and Megatron parallel state of its own at ``reward_model.megatron``'s
layout, in processes the actor's ranks do not share, so the two layouts never meet. It runs the worker
the colocated RM runs (:class:`mrl.workers.reward_model.RewardModelWorker`); every method is called on
all ranks with the same full batch and returns the same result.
"""
from __future__ import annotations

import os

import torch

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan
from mrl.dtypes import torch_dtype
from mrl.observability.fallbacks import collect_fallbacks, fallbacks_in_use
from mrl.workers.batch import TrainBatch

# Before Megatron is imported (by the worker, lazily): its fallback warnings are collected and the
# driver prints them once with the trainer ranks' (fallbacks()).
collect_fallbacks()


class RewardModelRank:
    """The frozen RM of this rank, in its own distributed world (``init_parallel`` from the group's env)."""

    def before_call(self) -> None:
        """Megatron's CPU redirect is per thread: entered on the thread of each call (as ``TrainRank``)."""
        if os.environ.get("MRL_DEVICE") == "cpu":
            from mrl.megatron.cpu_support import enable_cpu_support

            enable_cpu_support()

    def __init__(self, cfg: MRLConfig, plan: RunPlan) -> None:
        from mrl.workers.reward_model import RewardModelWorker

        torch.set_num_threads(int(os.environ.get("MRL_TORCH_THREADS", "1")))
        rm = cfg.reward_model
        self.rm = RewardModelWorker(rm.model.path, plan.layout["reward_model"].parallel,
                                    micro_batch_size=rm.micro_batch_size_per_gpu, device=plan.device,
                                    seed=cfg.trainer.seed, dtype=torch_dtype(plan.dtype))  # init_parallel: own world

    def compute_rm_score(self, batch: TrainBatch) -> torch.Tensor:
        """[B] reward-model scores of the full batch (the worker splits it over this group's DP ranks)."""
        return self.rm.compute_rm_score(batch)

    def fallbacks(self) -> list[str]:
        """The Megatron/torch fallbacks this rank's process hit (mrl/observability/fallbacks.py)."""
        return fallbacks_in_use()

    def close(self) -> None:
        from mrl.megatron.parallel import destroy_parallel

        destroy_parallel()
