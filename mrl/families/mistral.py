"""Mistral (``MistralForCausalLM``): llama's decoder; a set ``sliding_window`` windows every layer.

Declares: ``sliding_window`` (Megatron ``window_size=(W-1, 0)``, on the sdpa and te backends; the local
backend's window mask is CUDA-only and refused on CPU by the provider), and for the engine
``engine_refuses_sliding_window`` (its fast decode path has no window: transformers' forward runs it).
"""
from __future__ import annotations

from mrl.families.base import Family
from mrl.families.rules import DENSE_LAYER, MODEL_RULES

FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    weight_rules=MODEL_RULES + DENSE_LAYER,
    sliding_window=True,
    engine_refuses_sliding_window=True,
)
