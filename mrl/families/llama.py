"""Llama 2 / 3.x (``LlamaForCausalLM``): the plain pre-norm RMSNorm decoder with RoPE, GQA and SwiGLU.

Llama 3.x is this family with ``rope_scaling.rope_type="llama3"`` (read, for every family, by the
provider's rope reader: Megatron's llama3 scaling with its fixed low/high frequency factors).
Declares: no qkv bias (``attention_bias=true`` refused), no q/k norm, dense MLP, the common table.
"""
from __future__ import annotations

from mrl.families.base import Family
from mrl.families.rules import DENSE_LAYER, MODEL_RULES

FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    weight_rules=MODEL_RULES + DENSE_LAYER,
)
