"""Where phase ``rm_score`` sends the batch: the trainer ranks (colocated RM) or a group of its own (separate).

``reward_model.placement=separate`` (docs/reward_model.md, "Placement"): the RM runs as its own Ray
worker group of ``reward_model.num_devices`` ranks (:class:`mrl.workers.rm_rank.RewardModelRank`), in
a placement group of its own, built next to the trainer ranks and killed with them. The driver reaches
it through :class:`RewardModelRanks`, a typed proxy like ``TrainRanks`` (its methods mirror
``RewardModelRank``'s; tests/driver/test_ranks.py compares the signatures), so the step makes the same
call, ``compute_rm_score(batch) -> [B]``, whichever placement answers it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan
from mrl.driver.ranks import RankGroup, TrainRanks
from mrl.workers.batch import TrainBatch

if TYPE_CHECKING:
    from mrl.cluster import WorkerGroup


class RewardScorer(Protocol):
    """What phase rm_score (training and validation) calls: [B] scores of a batch, identical on every rank."""

    def compute_rm_score(self, batch: TrainBatch) -> torch.Tensor: ...


class RewardModelRanks:
    """Typed calls to every rank of a separate RM's group; rank 0's answer (all ranks return the same)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def compute_rm_score(self, batch: TrainBatch) -> torch.Tensor:
        return self.group.execute_all("compute_rm_score", batch)[0]

    def fallbacks(self) -> list[list[str]]:
        """Every rank's Megatron/torch fallbacks (printed once by the driver, with the trainer ranks')."""
        return self.group.execute_all("fallbacks")


def start_reward_model_group(cfg: MRLConfig, plan: RunPlan) -> WorkerGroup | None:
    """The separate RM's ranks (its models load while the caller goes on: ``wait_constructed()``); None
    when there is no separate RM (none, or colocated on the trainer ranks)."""
    if plan.reward_model_ranks == 0:
        return None
    from mrl.cluster import WorkerGroup

    return WorkerGroup("mrl.workers.rm_rank.RewardModelRank", {"cfg": cfg, "plan": plan},
                       world_size=plan.reward_model_ranks, device=plan.device,
                       extra_env={"OMP_NUM_THREADS": "1"}, wait=False)


def reward_scorer(rm_group: RankGroup | None, ranks: TrainRanks) -> RewardScorer:
    """The separate RM's proxy when it has a group, else the trainer ranks (which hold a colocated RM)."""
    return RewardModelRanks(rm_group) if rm_group is not None else ranks
