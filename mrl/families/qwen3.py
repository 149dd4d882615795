"""Qwen3 (``Qwen3ForCausalLM``): llama's decoder with a per-head RMSNorm on q and k (before RoPE).

Declares: ``qk_norm`` (``qk_layernorm`` in the config and the layer spec; the ``q_norm``/``k_norm``
rules, replicated over TP), no qkv bias (``attention_bias=true`` refused).
"""
from __future__ import annotations

from mrl.families.base import Family
from mrl.families.rules import DENSE_LAYER, MODEL_RULES, QK_NORM

FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    weight_rules=MODEL_RULES + DENSE_LAYER + QK_NORM,
    qk_norm=True,
)
