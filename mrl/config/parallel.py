"""Megatron-Core parallel layout of one role (actor, reference or critic).

Names follow Megatron-Core's ``ModelParallelConfig`` / verl's ``megatron`` sub-section.
The data-parallel size is derived, never set: ``DP = devices_of_role / (TP * PP * CP)``.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.base import Section

#: Megatron's uneven pipeline split (TransformerConfig fields of the same names).
UNEVEN_KEYS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


class ParallelConfig(Section):
    """Model-parallel sizes of one Megatron role; DP is derived from the devices the role gets."""

    tensor_model_parallel_size: int = Field(1, ge=1, description="Tensor-parallel size (TP): shards heads and MLP columns/rows.")
    pipeline_model_parallel_size: int = Field(1, ge=1, description="Pipeline-parallel size (PP): splits the layers into stages.")
    virtual_pipeline_model_parallel_size: int | None = Field(
        None, ge=1, description="Interleaved-1F1B model chunks per pipeline stage (VPP); null disables interleaving."
    )
    num_layers_in_first_pipeline_stage: int | None = Field(
        None, ge=1, description="Uneven pipeline stages (Megatron's and verl's override_transformer_config name): the "
        "first stage's layer count; the layers left after the first/last stage's are split evenly over the other "
        "stages. For layer counts PP does not divide (DeepSeek-V3's 61 layers at PP16: first 4, last 1). null = "
        "an even split.")
    num_layers_in_last_pipeline_stage: int | None = Field(
        None, ge=1, description="Uneven pipeline stages: the last stage's layer count (it also holds the output "
        "layer and the loss); null = an even split.")
    context_parallel_size: int = Field(1, ge=1, description="Context-parallel size (CP): each sequence of a packed row is cut into 2·CP chunks and rank r holds chunks r and 2·CP−1−r (zigzag), K/V all-gathered per layer. Runs for the actor, reference, critic, teacher and reward model on the sdpa attention backend with packed rows (actor.use_remove_padding; the reward model packs its own under CP); mrl plan refuses the rest naming why (docs/long_context.md).")
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
    def uneven_stages(self) -> dict[str, int]:
        """The uneven-split sizes that are set, as Megatron ``TransformerConfig`` kwargs."""
        return {k: v for k in UNEVEN_KEYS if (v := getattr(self, k)) is not None}

    @property
    def model_parallel_size(self) -> int:
        """TP * PP * CP: devices one model replica occupies."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
