"""Megatron-Core parallel layout of one role (actor, reference or critic).

Names follow Megatron-Core's ``ModelParallelConfig`` / verl's ``megatron`` sub-section.
The data-parallel size is derived, never set: ``DP = devices_of_role / (TP * PP * CP)``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.base import Section


class ParallelConfig(Section):
    """Model-parallel sizes of one Megatron role; DP is derived from the devices the role gets."""

    tensor_model_parallel_size: int = Field(1, ge=1, description="Tensor-parallel size (TP): shards heads and MLP columns/rows.")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Pipeline-parallel size (PP): splits the layers into stages.")
    virtual_pipeline_model_parallel_size: int | None = Field(
        None, ge=1, description="Interleaved-1F1B model chunks per pipeline stage (VPP); null disables interleaving."
    )
    context_parallel_size: int = Field(1, ge=1, description="Context-parallel size (CP); must be 1 for now: context parallelism is not implemented in mrl's workers on any backend yet, so mrl plan refuses > 1. For long sequences: actor.use_remove_padding with attention_backend=sdpa, activation recompute, and TP with sequence_parallel.")
    expert_model_parallel_size: int = Field(
        1, ge=1, description="Expert-parallel size (EP) for MoE layers (experts split over EP ranks; EP folds over TP and "
        "DP ranks: ETP * EP * PP must divide the role's devices); 1 for dense models.")
    expert_tensor_parallel_size: int | None = Field(
        None, ge=1, description="Tensor-parallel size inside each expert (ETP); null = tensor_model_parallel_size "
        "(Megatron's default). 1 with EP > 1 keeps experts whole (no TP communication inside an expert).")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism inside a TP group (needs TP > 1).")
    attention_backend: Literal["auto", "te", "sdpa", "local"] = Field(
        "auto", description="Core attention: te = Transformer Engine's fused kernels (CUDA with TE installed); sdpa = "
        "torch's scaled_dot_product_attention (flash / memory-efficient / cuDNN kernels on CUDA, the flash kernel on "
        "CPU: no s x s score matrix); local = Megatron's unfused DotProductAttention (materialises s x s scores per "
        "head). auto = te where TE is importable on CUDA (and no LoRA), else sdpa; mrl plan prints the choice "
        "(docs/megatron.md, 'Attention backends').")

    @property
    def etp(self) -> int:
        """ETP with its default (TP) applied."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """TP * PP * CP: devices one model replica occupies."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
