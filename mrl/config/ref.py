"""Reference-policy section: frozen copy of the initial actor for KL terms and ref_reward_blend.

A reference is built when ``actor.use_kl_loss``, ``algorithm.use_kl_in_reward`` or
``algorithm.ref_reward_blend.enable`` needs ``ref_log_prob`` [B, T] (verl; docs/driver.md, "Reward shaping"), or
``algorithm.repr_align`` needs its weights for the embeddings (docs/driver.md, "Reward shaping").
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.base import Section
from mrl.config.parallel import ParallelConfig


class RefConfig(Section):
    """Frozen reference model (verl ``actor_rollout_ref.ref``)."""

    enable: bool | None = Field(
        None, description="Build the reference; null = when use_kl_loss, use_kl_in_reward, ref_reward_blend or repr_align needs it."
    )
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: shares the actor's devices and model chunks (its weights swapped in from host memory); "
        "separate: Ray ranks of its own on ref.num_devices devices, at ref.megatron's layout, loading model.path."
    )
    num_devices: int | None = Field(None, ge=1, description="Devices of a separate reference; required when placement=separate.")
    megatron: ParallelConfig = Field(default_factory=ParallelConfig, description="Megatron parallel layout of a separate reference (a colocated one runs at actor.megatron's).")
    offload: bool = Field(False, description="Keep reference weights on CPU between passes; colocated always does, separate refuses it (not built).")
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="SAMPLES per forward on one DP rank; null = actor.log_prob_micro_batch_size_per_gpu."
    )
