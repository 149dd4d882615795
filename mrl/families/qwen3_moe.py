"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k RMSNorm) with every MLP an MoE layer.

Router: softmax → top-k, renormalised when ``norm_topk_prob``; experts of width
``moe_intermediate_size`` stored per expert as ``mlp.experts.{e}.{gate,up,down}_proj``; no shared expert.
Mixed dense/MoE layers: layer ``i`` is MoE iff ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step
== 0`` (Megatron ``moe_layer_freq``); a dense layer is a SwiGLU MLP of ``intermediate_size`` stored as
``mlp.{gate,up,down}_proj`` (the ``layers="dense"`` rules). The engine's
fast decode path leaves a set ``sliding_window`` to transformers (Megatron builds no window for it).
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, MoE, qwen_moe_layers
from mrl.families.rules import (
    ATTENTION,
    DENSE_MLP_OF_MIXED,
    MODEL_RULES,
    QK_NORM,
    moe_rules,
)

_EXPERTS = ("gate_proj", "up_proj", "down_proj")


def _expert_ffn(hf_config: Any) -> int:
    return int(hf_config.moe_intermediate_size)


def _norm_topk(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "norm_topk_prob", False))


FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    weight_rules=MODEL_RULES + ATTENTION + QK_NORM + moe_rules("mlp", *_EXPERTS) + DENSE_MLP_OF_MIXED,
    qk_norm=True,
    moe=MoE(block="mlp", expert_names=_EXPERTS, expert_ffn_size=_expert_ffn, norm_topk=_norm_topk,
            layers=qwen_moe_layers),
    engine_refuses_sliding_window=True,
)
