"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (qkv bias), routed experts plus a shared expert.

Router as Qwen3-MoE's (softmax → top-k, renormalised when ``norm_topk_prob``); the shared expert
(``shared_expert_intermediate_size``) is added through a sigmoid gate, ``sigmoid(g·x) · shared(x)``
(Megatron ``moe_shared_expert_gate``). Mixed dense/MoE layers by Qwen3-MoE's rule (``mlp_only_layers``,
``decoder_sparse_step``); a dense layer is one SwiGLU MLP of ``intermediate_size`` with no shared expert.
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, MoE, qwen_moe_layers
from mrl.families.qwen3_moe import _EXPERTS, _expert_ffn, _norm_topk
from mrl.families.rules import (
    ATTENTION,
    DENSE_MLP_OF_MIXED,
    MODEL_RULES,
    QKV_BIAS,
    L,
    Rule,
    moe_rules,
)

_SHARED_EXPERT = (
    Rule("mlp.shared_experts.linear_fc1.weight",
         (L + "mlp.shared_expert.gate_proj.weight", L + "mlp.shared_expert.up_proj.weight"), "gate_up",
         layers="moe"),
    Rule("mlp.shared_experts.linear_fc2.weight", (L + "mlp.shared_expert.down_proj.weight",), "row", layers="moe"),
    Rule("mlp.shared_experts.gate_weight", (L + "mlp.shared_expert_gate.weight",), "replicated", layers="moe"),
)


def _shared_expert_size(hf_config: Any) -> int:
    return int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)


FAMILY = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    weight_rules=MODEL_RULES + ATTENTION + QKV_BIAS + moe_rules("mlp", *_EXPERTS) + _SHARED_EXPERT
    + DENSE_MLP_OF_MIXED,
    qkv_bias=True,
    moe=MoE(block="mlp", expert_names=_EXPERTS, expert_ffn_size=_expert_ffn, norm_topk=_norm_topk,
            shared_expert_size=_shared_expert_size, layers=qwen_moe_layers),
)
