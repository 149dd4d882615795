"""Optimizer and learning-rate schedule of a trained role (actor, critic).

Adam(W) with decoupled weight decay as in Megatron-Core's ``OptimizerConfig``; the schedule is
``lr(t) = lr * warmup(t) * decay(t)`` with linear warmup over ``lr_warmup_steps`` (or
``lr_warmup_steps_ratio * total_training_steps``) and a decay to ``min_lr_ratio * lr``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mrl.config.base import Section


class OptimConfig(Section):
    """AdamW hyper-parameters and LR schedule (verl ``actor.optim`` names)."""

    lr: float = Field(1e-6, gt=0, description="Peak learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam (beta1, beta2).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(0.01, ge=0, description="Decoupled (AdamW) weight decay.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warmup length in optimizer steps; 0 means use lr_warmup_steps_ratio.")
    lr_warmup_steps_ratio: float = Field(
        0.0, ge=0, le=1, description="Warmup as a fraction of total_training_steps (used when lr_warmup_steps is 0)."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="Decay after warmup: constant|linear|cosine.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final LR as a fraction of lr for linear/cosine decay.")
    clip_grad: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 disables clipping.")
    total_training_steps: int | None = Field(
        None, ge=1, description="LR-schedule length in trainer steps (verl steps the scheduler once per step); null = "
        "the run length (trainer.total_training_steps, or total_epochs x batches per epoch)."
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"Adam betas must each lie in [0, 1), got {list(v)}; fix: e.g. betas=[0.9,0.999]")
        return v
