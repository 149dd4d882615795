"""Megatron-Core parallel layout of one role (actor, reference or critic).

Names follow Megatron-Core's ``ModelParallelConfig`` / verl's ``megatron`` sub-section.
The data-parallel size is derived, never set: ``DP = devices_of_role / (TP * PP * CP)``.
"""
from __future__ import annotations

from pydantic import Field

from mrl.config.base import Section


class ParallelConfig(Section):
    """Model-parallel sizes of one Megatron role; DP is derived from the devices the role gets."""

    tensor_model_parallel_size: int = Field(1, ge=1, description="Tensor-parallel size (TP): shards heads and MLP columns/rows.")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Pipeline-parallel size (PP): splits the layers into stages.")
    virtual_pipeline_model_parallel_size: int | None = Field(
        None, ge=1, description="Interleaved-1F1B model chunks per pipeline stage (VPP); null disables interleaving."
    )
    context_parallel_size: int = Field(1, ge=1, description="Context-parallel size (CP): splits each sequence across ranks.")
    expert_model_parallel_size: int = Field(
        1, ge=1, description="Expert-parallel size (EP) for MoE layers (experts split over EP ranks; EP folds over TP and "
        "DP ranks: ETP * EP * PP must divide the role's devices); 1 for dense models.")
    expert_tensor_parallel_size: int | None = Field(
        None, ge=1, description="Tensor-parallel size inside each expert (ETP); null = tensor_model_parallel_size "
        "(Megatron's default). 1 with EP > 1 keeps experts whole (no TP communication inside an expert).")
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism inside a TP group (needs TP > 1).")

    @property
    def etp(self) -> int:
        """ETP with its default (TP) applied."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def model_parallel_size(self) -> int:
        """TP * PP * CP: devices one model replica occupies."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
