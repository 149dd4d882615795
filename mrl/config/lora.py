"""LoRA section of the actor: low-rank adapters on the attention and MLP projections.

With ``rank > 0`` every target projection ``W`` (frozen) gets a trainable update
``ΔW = (alpha / rank) · B · A`` with ``A ∈ R^{rank × in}`` and ``B ∈ R^{out × rank}`` (Hu et al.
2021; the names and initialisation of Hugging Face ``peft``: A Kaiming-uniform, B zero, so the
first policy equals the base model). Only A and B are trained and hold optimizer state; the
reference policy is the same model with its adapters switched off (verl's ``ref_in_actor``).
Layout over tensor parallelism and the fused projections: docs/lora.md.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from mrl.config.base import Section

LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                     "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj", "all-linear"]
# Hugging Face projection names of the attention and MLP of every supported decoder family.
ATTENTION_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A hybrid decoder's Gated DeltaNet projections (HF ``linear_attn.*``): Qwen3.5 / Qwen3.6's in_proj_qkv, in_proj_z,
# in_proj_b, in_proj_a; Qwen3-Next's grouped in_proj_qkvz, in_proj_ba; both out_proj. A model without them adapts none.
GATED_DELTA_NET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")
ALL_LINEAR = ATTENTION_MLP + GATED_DELTA_NET
QWEN3_5_GDN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
QWEN3_NEXT_GDN = ("in_proj_qkvz", "in_proj_ba", "out_proj")


def model_projections(linear_layers: int, model_type: str) -> tuple[str, ...]:
    """The HF projection names a decoder has (config.json's numbers: Gated DeltaNet layers, Qwen3-Next's grouped
    in_proj_qkvz / in_proj_ba by its model_type)."""
    if not linear_layers:
        return ATTENTION_MLP
    return ATTENTION_MLP + (QWEN3_NEXT_GDN if model_type == "qwen3_next" else QWEN3_5_GDN)


class LoraConfig(Section):
    """Low-rank adapters on the actor (verl ``actor_rollout_ref.model.lora_rank`` / ``lora_alpha`` / ``target_modules``)."""

    rank: int = Field(0, ge=0, description="Adapter rank r; 0 = LoRA off (full fine-tuning).")
    alpha: float = Field(16.0, gt=0, description="Scaling numerator: ΔW = (alpha / rank) · B · A (peft's lora_alpha).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input during training (peft's lora_dropout).")
    target_modules: list[LoraTarget] = Field(
        default_factory=lambda: ["all-linear"],
        description="Hugging Face projection names that get adapters (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
        "down_proj; on a hybrid Qwen3.5 / Qwen3-Next also its Gated DeltaNet in_proj_qkv,in_proj_z,in_proj_b,"
        "in_proj_a / in_proj_qkvz,in_proj_ba and out_proj) or all-linear for every one the model has.",
    )
    separate_reference: bool = Field(
        False, description="With LoRA the reference is the base model (adapters off, no second copy); true allows "
        "ref.placement=separate anyway (a second full model).",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, v: object) -> object:
        # verl's and peft's string form (`target_modules: all-linear`), or one projection name: a 1-list
        return [v] if isinstance(v, str) else v

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def targets(self) -> tuple[str, ...]:
        """Expanded target names in canonical order (all-linear → every name of ALL_LINEAR: the model adapts those it
        has)."""
        chosen = set(ALL_LINEAR) if "all-linear" in self.target_modules else set(self.target_modules)
        return tuple(t for t in ALL_LINEAR if t in chosen)
