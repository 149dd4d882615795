"""Qwen3-Next (``Qwen3NextForCausalLM``): the hybrid decoder Qwen3.5 grew from — Gated DeltaNet and gated attention
layers (``layer_types`` / ``full_attention_interval``), zero-centred RMSNorms, partial RoPE — with an MoE MLP in every
layer the Qwen rule makes sparse (``decoder_sparse_step``, ``mlp_only_layers``; all of them in the released 80B-A3B)
and a gated shared expert; text only, no vision tower.

Its checkpoint stores the Gated DeltaNet input projection grouped per key head (``in_proj_qkvz``: ``[q | k | v | z]``
of each key head's group, ``in_proj_ba``: ``[b | a]``; the ``gdn_grouped`` split of :mod:`mrl.megatron.mapping`);
the conv1d, ``A_log``, ``dt_bias``, the gated norm, the attention and the MoE are Qwen3.5's
(:mod:`mrl.families.qwen3_5`, :mod:`mrl.families.qwen3_5_moe`).
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, MoE, qwen_moe_layers
from mrl.families.qwen3_5 import (
    GATED_ATTENTION,
    GATED_DELTA_NET,
    HYBRID,
    NORMS,
    G,
    refuse,
)
from mrl.families.qwen3_5_moe import _EXPERTS, _SHARED_EXPERT, _expert_ffn, _shared
from mrl.families.rules import DENSE_MLP_OF_MIXED, MODEL_RULES, Rule, moe_rules

GROUPED_IN_PROJ = Rule("self_attention.in_proj.weight", (G + "in_proj_qkvz.weight", G + "in_proj_ba.weight"),
                       "gdn_grouped", mixer="linear")
GATED_DELTA_NET_GROUPED = (GROUPED_IN_PROJ,) + tuple(r for r in GATED_DELTA_NET
                                                      if r.mcore != "self_attention.in_proj.weight")


def _refuse(hf_config: Any) -> None:
    refuse(hf_config)
    if not all(qwen_moe_layers(hf_config)):
        raise ValueError("config.json decoder_sparse_step / mlp_only_layers make some Qwen3-Next layers dense: mixing "
                         "dense and MoE MLPs in a hybrid-attention model is not built yet (every released size is all-MoE)")


def _norm_topk(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "norm_topk_prob", True))


FAMILY = Family(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    weight_rules=MODEL_RULES + NORMS + GATED_ATTENTION + GATED_DELTA_NET_GROUPED + moe_rules("mlp", *_EXPERTS)
    + _SHARED_EXPERT + DENSE_MLP_OF_MIXED,
    moe=MoE(block="mlp", expert_names=_EXPERTS, expert_ffn_size=_expert_ffn, norm_topk=_norm_topk,
            shared_expert_size=_shared, layers=qwen_moe_layers),
    refuse=_refuse,
    **HYBRID,
)
