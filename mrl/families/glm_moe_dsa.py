"""GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's architecture (:mod:`mrl.families.deepseek_v32`: MLA, DeepSeek
Sparse Attention, the sigmoid router with its score-correction bias, shared expert, dense first layers) with the
indexer's RoPE in the *interleaved* pair layout (transformers 5.25's ``GlmMoeDsaIndexer``) and GLM-5's own sizes.

GLM-5 may share one layer's top-k with the next (``indexer_types`` entries ``"shared"``, from ``index_topk_freq`` /
``index_topk_pattern``): refused (every released layer pattern mrl builds runs its own indexer, ``"full"``).
"""
from __future__ import annotations

from typing import Any

from mrl.families import deepseek_v3 as v3
from mrl.families import deepseek_v32 as v32
from mrl.families.base import Family


def refuse(hf_config: Any) -> None:
    v32.refuse(hf_config)
    types = list(getattr(hf_config, "indexer_types", None) or [])
    if any(t != "full" for t in types):
        raise ValueError(f"config.json indexer_types={types} (from index_topk_freq / index_topk_pattern): layers "
                         "that reuse another layer's top-k ('shared') are not supported; only 'full' layers are")


FAMILY = Family(
    name="glm_moe_dsa",
    architectures=("GlmMoeDsaForCausalLM",),
    weight_rules=v32.RULES,
    mla=v3.mla_kwargs,
    dsa=v32.dsa_sizes(rope_interleaved=True),
    moe=v32.MOE,
    refuse=refuse,
    plan_notes=v32.plan_notes,
)
