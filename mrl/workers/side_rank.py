"""The side models' workers by role, and one rank of a separate side model (``<role>.placement=separate``;
docs/reward_model.md and docs/distillation.md, "Placement"), or of a separate reference (``ref.placement=separate``:
the same frozen log-prob forward as the teacher's, of ``model.path``).

:func:`build_side_worker` is the one place that maps a role (its config section's key, as
``MRLConfig.rank_side_models`` lists them) to the worker that computes it; the trainer ranks build their
colocated side models with it, :class:`SideModelRank` a separate one.

A :class:`SideModelRank` is constructed inside a rank actor of the side model's own ``mrl.cluster.WorkerGroup``,
whose RANK/WORLD_SIZE/MASTER_PORT are that group's (rank 0's free port): it forms a torch.distributed world of
its own (gloo on CPU, NCCL on CUDA) and Megatron parallel state of its own at the role's layout
(``<role>.megatron``, null = the actor's sizes), in processes the actor's ranks do not share, so the two
layouts never meet. Every method is called on all ranks with the same full batch and returns the same result.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan
from mrl.observability.fallbacks import collect_fallbacks, fallbacks_in_use
from mrl.workers.batch import TrainBatch

if TYPE_CHECKING:
    from mrl.config.parallel import ParallelConfig
    from mrl.workers.side_model import SideModelWorker

# Before Megatron is imported (by the worker, lazily): its fallback warnings are collected and the
# driver prints them once with the trainer ranks' (fallbacks()).
collect_fallbacks()


def build_side_worker(role: str, cfg: MRLConfig, plan: RunPlan, parallel: ParallelConfig, *, device: str,
                      init_parallel: bool) -> SideModelWorker:
    """The worker of side model ``role`` (imported here, in the rank process: Megatron comes with it)."""
    if role == "reward_model":
        from mrl.workers.reward_model import RewardModelWorker as worker
    elif role == "teacher":
        from mrl.workers.teacher import TeacherWorker as worker
    elif role == "ref":  # only separate: the colocated reference swaps into the actor's chunks (reference.py)
        from mrl.workers.reference import ReferenceWorker as worker
    else:
        raise ValueError(f"no side-model worker for role {role!r} (known: reward_model, teacher, ref)")
    return worker.from_config(cfg, plan, parallel, device=device, init_parallel=init_parallel)


class SideModelRank:
    """The frozen side model ``role`` of this rank, in its own distributed world (``init_parallel`` from the
    group's env)."""

    def before_call(self) -> None:
        """Megatron's CPU redirect is per thread: entered on the thread of each call (as ``TrainRank``)."""
        if os.environ.get("MRL_DEVICE") == "cpu":
            from mrl.megatron.cpu_support import enable_cpu_support

            enable_cpu_support()

    def __init__(self, cfg: MRLConfig, plan: RunPlan, role: str) -> None:
        torch.set_num_threads(int(os.environ.get("MRL_TORCH_THREADS", "1")))
        self.role = role
        self.worker = build_side_worker(role, cfg, plan, plan.layout[role].parallel, device=plan.device,
                                        init_parallel=True)

    def compute_side(self, role: str, batch: TrainBatch) -> torch.Tensor:
        """What side model ``role`` computes about the full batch (the worker splits it over this group's DP
        ranks): the reward model's [B] scores, the teacher's or the reference's [B, R] log-probs."""
        if role != self.role:
            raise RuntimeError(f"compute_side({role!r}) reached the ranks of side model {self.role!r}")
        return self.worker.compute(batch)

    def fallbacks(self) -> list[str]:
        """The Megatron/torch fallbacks this rank's process hit (mrl/observability/fallbacks.py)."""
        return fallbacks_in_use()

    def close(self) -> None:
        from mrl.megatron.parallel import destroy_parallel

        destroy_parallel()
