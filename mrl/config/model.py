"""Model section: the Hugging Face checkpoint every role starts from."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.base import Section


class ModelConfig(Section):
    """Policy checkpoint (verl ``actor_rollout_ref.model``)."""

    path: str | None = Field(None, description="HF checkpoint directory (config.json, safetensors, tokenizer); required.")
    tokenizer_path: str | None = Field(None, description="Tokenizer directory; null = path.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field("bfloat16", description="Parameter/compute dtype of actor, reference and engines.")
    trust_remote_code: bool = Field(False, description="Allow executing code shipped with the checkpoint (off: secure default).")
    make_vocab_size_divisible_by: int = Field(
        128, ge=1, description="Pad the vocabulary to a multiple of this * TP (Megatron); padded logits are masked."
    )
