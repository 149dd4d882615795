"""Critic (value model) section for GAE-based PPO.

Value loss (verl ``compute_value_loss``): ``max((V - R)^2, (clip(V, V_old ± cliprange_value) - R)^2) / 2``
over response tokens [B, T], reduced by ``loss_agg_mode``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.actor import LossAggMode
from mrl.config.base import Section
from mrl.config.optim import OptimConfig
from mrl.config.parallel import ParallelConfig


class CriticOptimConfig(OptimConfig):
    """Critic optimizer: as OptimConfig with verl's critic learning rate (1e-5) as the default."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate (critic default 1e-5, as verl).")


class CriticConfig(Section):
    """Value model; enabled by ``enable=true`` or by ``algorithm.adv_estimator=gae`` when enable is null."""

    enable: bool | None = Field(None, description="Build a critic; null = only when algorithm.adv_estimator is gae.")
    model_path: str | None = Field(None, description="HF checkpoint of the critic; null = model.path (value head initialised fresh).")
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: shares the actor's devices; separate: own devices (num_devices)."
    )
    num_devices: int | None = Field(None, ge=1, description="Devices of a separate critic; required when placement=separate.")
    megatron: ParallelConfig = Field(default_factory=ParallelConfig, description="Megatron parallel layout of the critic.")
    optim: CriticOptimConfig = Field(default_factory=CriticOptimConfig, description="Critic optimizer and LR schedule.")
    use_distributed_optimizer: bool = Field(True, description="Shard Adam state over DP ranks (Megatron).")
    ppo_mini_batch_size: int | None = Field(None, ge=1, description="PROMPTS per critic optimizer step; null = actor.ppo_mini_batch_size.")
    ppo_micro_batch_size_per_gpu: int | None = Field(None, ge=1, description="SAMPLES per forward/backward per DP rank.")
    use_dynamic_bsz: bool = Field(False, description="Pack micro-batches by token count instead of sample count.")
    ppo_max_token_len_per_gpu: int = Field(32768, ge=1, description="TOKENS per micro-batch per DP rank when use_dynamic_bsz.")
    ppo_epochs: int | None = Field(None, ge=1, description="Passes over each batch; null = actor.ppo_epochs.")
    cliprange_value: float = Field(0.5, ge=0, description="Value clip range around the old values.")
    loss_agg_mode: LossAggMode = Field("token-mean", description="How [B, T] value losses are reduced.")
    recompute_granularity: Literal["full", "selective"] | None = Field(None, description="Activation recomputation: full|selective|null.")
    offload_param: bool = Field(False, description="Move critic weights to CPU outside its phases.")
    offload_grad: bool = Field(False, description="Move critic gradients to CPU outside the update.")
    offload_optimizer: bool = Field(False, description="Move critic Adam state to CPU outside the update.")
