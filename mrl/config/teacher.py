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

from pydantic import Field

from mrl.config.side_model import RankSideModelConfig


class TeacherConfig(RankSideModelConfig):
    """Frozen teacher model of on-policy distillation (``algorithm.distill``); its placement, layout, offload and
    micro-batch keys are the side-model base's (mrl/config/side_model.py)."""

    enable: bool = Field(False, description="Build the teacher and run phase teacher_log_prob (needs algorithm.distill.mode).")
    path: str | None = Field(None, description="HF causal-LM checkpoint directory of the teacher; its tokenizer must "
                             "have the student's vocabulary (model.path's), id for id.")

    def model_dir(self) -> str | None:
        return self.path
