"""Where phase ``teacher_log_prob`` sends the batch: the trainer ranks (colocated teacher) or a group of its own.

``teacher.placement=separate`` (docs/distillation.md, "Placement"): the teacher runs as its own Ray worker
group of ``teacher.num_devices`` ranks (:class:`mrl.workers.teacher_rank.TeacherRank`) in a placement
group of its own, built next to the trainer ranks and killed with them; the driver reaches it through
:class:`TeacherRanks`, a typed proxy like ``TrainRanks`` (tests/workers/test_ranks.py compares the
signatures), so the step makes the same call, ``compute_teacher_log_prob(batch) -> [B, R]``, whichever
placement answers it.
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


class TeacherScorer(Protocol):
    """What phase teacher_log_prob calls: [B, R] teacher log-probs, identical on every rank."""

    def compute_teacher_log_prob(self, batch: TrainBatch) -> torch.Tensor: ...


class TeacherRanks:
    """Typed calls to every rank of a separate teacher's group; rank 0's answer (all ranks return the same)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def compute_teacher_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        return self.group.execute_all("compute_teacher_log_prob", batch)[0]

    def fallbacks(self) -> list[list[str]]:
        return self.group.execute_all("fallbacks")


def start_teacher_group(cfg: MRLConfig, plan: RunPlan) -> WorkerGroup | None:
    """The separate teacher's ranks (loading while the caller goes on: ``wait_constructed()``); None when the
    teacher is off or colocated on the trainer ranks."""
    if plan.teacher_ranks == 0:
        return None
    from mrl.cluster import WorkerGroup

    return WorkerGroup("mrl.workers.teacher_rank.TeacherRank", {"cfg": cfg, "plan": plan},
                       world_size=plan.teacher_ranks, device=plan.device,
                       extra_env={"OMP_NUM_THREADS": "1"}, wait=False)


def teacher_scorer(teacher_group: RankGroup | None, ranks: TrainRanks) -> TeacherScorer:
    """The separate teacher's proxy when it has a group, else the trainer ranks (which hold a colocated one)."""
    return TeacherRanks(teacher_group) if teacher_group is not None else ranks
