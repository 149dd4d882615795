"""Teacher section: a frozen causal LM whose log-probs of the student's sampled tokens drive on-policy
distillation (``algorithm.distill``; docs/distillation.md).

The teacher is its own Hugging Face checkpoint (usually larger or better trained than the student)
with the student's vocabulary: token-level distillation compares ``log π_teacher(a_t|s_t)`` with
``log π_student(a_t|s_t)`` token by token, so both must spell every sequence with the same ids
(checked before anything starts). ``placement: colocated`` (default) runs it on the actor's ranks
with the actor's Megatron layout and groups (a model of its own, not swapped into the actor's
chunks: its shape may differ); ``separate`` gives it ``num_devices`` devices, its own Ray worker group,
torch.distributed world and Megatron layout (``megatron``; null = the actor's sizes), as the separate
reward model. Phase ``teacher_log_prob`` runs after ``old_log_prob``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.base import Section
from mrl.config.parallel import ParallelConfig


class TeacherConfig(Section):
    """Frozen teacher model of on-policy distillation (``algorithm.distill``)."""

    enable: bool = Field(False, description="Build the teacher and run phase teacher_log_prob (needs algorithm.distill.mode).")
    path: str | None = Field(None, description="HF causal-LM checkpoint directory of the teacher; its tokenizer must "
                             "have the student's vocabulary (model.path's), id for id.")
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: on the actor's ranks with actor.megatron's layout (devices shared phase by "
        "phase); separate: on teacher.num_devices devices of its own after the actor's, with its own Ray worker group, "
        "torch.distributed world and teacher.megatron layout.")
    num_devices: int | None = Field(None, ge=1, description="Devices of a separate teacher (taken from "
                                    "cluster.nnodes*n_gpus_per_node, the actor gets the rest); required with "
                                    "placement=separate, refused with colocated.")
    megatron: ParallelConfig | None = Field(
        None, description="Megatron layout of a separate teacher (DP = num_devices / (TP*PP)); null = actor.megatron's "
        "sizes. A colocated teacher runs in the actor's groups: null or equal to actor.megatron.")
    offload: bool = Field(False, description="Colocated only: keep the teacher's weights in host memory outside phase "
                          "teacher_log_prob (a no-op on CPU).")
    micro_batch_size_per_gpu: int = Field(8, ge=1, description="SAMPLES per teacher forward on one DP rank.")
