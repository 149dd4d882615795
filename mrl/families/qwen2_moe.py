"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (qkv bias), routed experts plus a shared expert.

Router as Qwen3-MoE's (softmax → top-k, renormalised when ``norm_topk_prob``); the shared expert
(``shared_expert_intermediate_size``) is added through a sigmoid gate, ``sigmoid(g·x) · shared(x)``
(Megatron ``moe_shared_expert_gate``). Refuses layers mixing dense and MoE.
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, MoE, refuse_mixed_dense_moe
from mrl.families.qwen3_moe import _EXPERTS, _expert_ffn, _norm_topk
from mrl.families.rules import ATTENTION, MODEL_RULES, QKV_BIAS, L, Rule, moe_rules

_SHARED_EXPERT = (
    Rule("mlp.shared_experts.linear_fc1.weight",
         (L + "mlp.shared_expert.gate_proj.weight", L + "mlp.shared_expert.up_proj.weight"), "gate_up"),
    Rule("mlp.shared_experts.linear_fc2.weight", (L + "mlp.shared_expert.down_proj.weight",), "row"),
    Rule("mlp.shared_experts.gate_weight", (L + "mlp.shared_expert_gate.weight",), "replicated"),
)


def _shared_expert_size(hf_config: Any) -> int:
    return int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)


FAMILY = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    weight_rules=MODEL_RULES + ATTENTION + QKV_BIAS + moe_rules("mlp", *_EXPERTS) + _SHARED_EXPERT,
    qkv_bias=True,
    moe=MoE(block="mlp", expert_names=_EXPERTS, expert_ffn_size=_expert_ffn, norm_topk=_norm_topk,
            shared_expert_size=_shared_expert_size, refuse=refuse_mixed_dense_moe),
)
