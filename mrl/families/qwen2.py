"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): llama's decoder with a bias on q, k and v.

Declares: ``qkv_bias`` (Megatron ``add_qkv_bias``, the ``linear_qkv.bias`` rule interleaved per query
group like the weight); embeddings tied or not as config.json says (common to all families).
``use_sliding_window=true`` (windows on some layers only) is refused by the provider's common checks.
"""
from __future__ import annotations

from mrl.families.base import Family
from mrl.families.rules import DENSE_LAYER, MODEL_RULES, QKV_BIAS

FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    weight_rules=MODEL_RULES + DENSE_LAYER + QKV_BIAS,
    qkv_bias=True,
)
