"""Model section: the Hugging Face checkpoint every role starts from."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.base import Section


class ModelConfig(Section):
    """Policy checkpoint (verl ``actor_rollout_ref.model``)."""

    path: str | None = Field(None, description="HF checkpoint directory (config.json, safetensors, tokenizer); required.")
    tokenizer_path: str | None = Field(None, description="Tokenizer directory; null = path.")
    dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="Parameter/compute dtype of actor, reference, critic, reward model and engines (Megatron mixed "
        "precision: fp32 main weights in the optimizer); null = bfloat16 on cuda, float32 on cpu.")
    trust_remote_code: bool = Field(False, description="Allow executing code shipped with the checkpoint (off: secure default).")
    make_vocab_size_divisible_by: int = Field(
        128, ge=1, description="Pad the vocabulary to a multiple of this * TP (Megatron); padded logits are masked."
    )

    def compute_dtype(self, device: str) -> str:
        """``dtype``, or its default on ``device`` (``cuda`` / ``cpu``) when null."""
        return self.dtype or ("float32" if device == "cpu" else "bfloat16")
