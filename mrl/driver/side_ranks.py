"""Where a side model's phase sends the batch: the trainer ranks (colocated) or a group of its own (separate).

``<role>.placement=separate`` (docs/reward_model.md and docs/distillation.md, "Placement"): the side model
runs as its own Ray worker group of ``<role>.num_devices`` ranks (:class:`mrl.workers.side_rank.SideModelRank`),
in a placement group of its own, built next to the trainer ranks and killed with them. The driver reaches it
through :class:`SideModelRanks`, a typed proxy like ``TrainRanks`` (its methods mirror ``SideModelRank``'s;
tests/workers/test_ranks.py compares the signatures). A phase holds a :class:`SideModel` and makes one call,
``side(batch)`` -> ``compute_side(role, batch)``, whichever placement answers it: the reward model's
``rm_score`` [B], the teacher's ``teacher_log_prob`` [B, R].
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan
from mrl.driver.ranks import RankGroup, TrainRanks
from mrl.workers.batch import TrainBatch

if TYPE_CHECKING:
    from mrl.cluster import WorkerGroup


class SideModelRanks:
    """Typed calls to every rank of a separate side model's group; rank 0's answer (all ranks return the same)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def compute_side(self, role: str, batch: TrainBatch) -> torch.Tensor:
        return self.group.execute_all("compute_side", role, batch)[0]

    def fallbacks(self) -> list[list[str]]:
        """Every rank's Megatron/torch fallbacks (printed once by the driver, with the trainer ranks')."""
        return self.group.execute_all("fallbacks")


class SideModel:
    """Side model ``role`` as its phase calls it: ``side(batch)``, answered by the trainer ranks (colocated) or
    by its own group's proxy (separate)."""

    def __init__(self, role: str, ranks: TrainRanks | SideModelRanks) -> None:
        self.role, self.ranks = role, ranks

    def __call__(self, batch: TrainBatch) -> torch.Tensor:
        return self.ranks.compute_side(self.role, batch)

    def fallbacks(self) -> list[list[str]]:
        """Its own group's fallbacks; [] when colocated (the trainer ranks report theirs)."""
        return self.ranks.fallbacks() if isinstance(self.ranks, SideModelRanks) else []


def start_side_group(cfg: MRLConfig, plan: RunPlan, role: str) -> WorkerGroup | None:
    """Side model ``role``'s own ranks (its model loads while the caller goes on: ``wait_constructed()``); None
    when it has none (off, or colocated on the trainer ranks)."""
    layout = plan.layout.get(role)
    if layout is None or layout.colocated:
        return None
    from mrl.cluster import WorkerGroup

    return WorkerGroup("mrl.workers.side_rank.SideModelRank", {"cfg": cfg, "plan": plan, "role": role},
                       world_size=layout.count, device=plan.device, extra_env={"OMP_NUM_THREADS": "1"}, wait=False)


def side_model(role: str, group: RankGroup | None, ranks: TrainRanks) -> SideModel:
    """The separate side model's proxy when it has a group, else the trainer ranks (which hold a colocated one)."""
    return SideModel(role, SideModelRanks(group) if group is not None else ranks)
