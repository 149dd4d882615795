"""The worker base of a side model (mrl/config/side_model.py): one frozen Megatron model on this rank that
computes something about a batch, identical on every rank.

Frozen: no DDP, no optimizer (``MegatronModel(train=False)``). Colocated it runs in the actor's processes
and Megatron groups (``init_parallel=False``) and may wait in host memory between its phases
(:meth:`SideModelWorker.offload`); separate, in a worker group of its own
(:class:`mrl.workers.side_rank.SideModelRank`). What it computes is the subclass's :meth:`~SideModelWorker.compute`:
the reward model's [B] scores (mrl/workers/reward_model.py), the teacher's [B, R] log-probs
(mrl/workers/teacher.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mrl.workers.batch import TrainBatch

if TYPE_CHECKING:
    from mrl.config import MRLConfig
    from mrl.config.parallel import ParallelConfig
    from mrl.config.run_plan import RunPlan
    from mrl.workers.megatron_model import MegatronModel


class SideModelWorker:
    """A frozen side model on this rank (module doc); ``micro_batch_size``: SAMPLES per forward on one DP rank
    (checked before the subclass builds ``model``, its Megatron model)."""

    what = "side model"  # the error messages' name

    model: MegatronModel

    def __init__(self, micro_batch_size: int) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"{self.what} micro_batch_size must be >= 1, got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self._offloaded: Any = None

    @classmethod
    def from_config(cls, cfg: MRLConfig, plan: RunPlan, parallel: ParallelConfig, *, device: str,
                    init_parallel: bool) -> SideModelWorker:
        """The worker of its config section at ``parallel`` (colocated: the actor's, ``init_parallel=False``)."""
        raise NotImplementedError

    def compute(self, batch: TrainBatch) -> torch.Tensor:
        """What the model computes about the full ``batch``, identical on every rank (split over this group's
        DP ranks inside)."""
        raise NotImplementedError

    def dp_padded(self, batch: TrainBatch) -> tuple[TrainBatch, int]:
        """``batch`` padded with copies of its last sample to a multiple of the DP size (validation chunks, odd
        batches), and how many were added; their rows are dropped from the answer."""
        B = batch.batch_size
        extra = -B % self.model.dp_size
        if extra:
            batch = batch.index(list(range(B)) + [B - 1] * extra)
        return batch, extra

    def offload(self, *, force: bool = False) -> None:
        """Weights to host memory until :meth:`onload` (the section's ``offload``; a no-op on CPU unless ``force``,
        which tests use to exercise the round trip)."""
        from mrl.workers.offload import offload_state

        self._offloaded = offload_state(self.model, force=force)

    def onload(self) -> None:
        from mrl.workers.offload import onload_state

        onload_state(self._offloaded)
        self._offloaded = None
