"""Qwen3.5 / Qwen3.6 MoE (``Qwen3_5MoeForConditionalGeneration``, text-only ``Qwen3_5MoeForCausalLM``): the hybrid
decoder of :mod:`mrl.families.qwen3_5` with every MLP an MoE block.

Router: ``p = softmax(W x)``, top-k renormalised (always: transformers' ``Qwen3_5MoeTopKRouter`` divides by the
top-k sum); routed experts of ``moe_intermediate_size`` stored per expert as ``mlp.experts.{e}.{gate,up,down}_proj``;
a gated shared expert ``sigmoid(w_g · x) · SwiGLU_shared(x)`` of ``shared_expert_intermediate_size``
(``mlp.shared_expert.*``, ``mlp.shared_expert_gate``; Megatron ``moe_shared_expert_gate``).
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, MoE
from mrl.families.qwen3_5 import HYBRID, HYBRID_LAYER, WRAPPED, refuse
from mrl.families.rules import MODEL_RULES, L, Rule, moe_rules

_EXPERTS = ("gate_proj", "up_proj", "down_proj")
_SHARED_EXPERT = (
    Rule("mlp.shared_experts.linear_fc1.weight",
         (L + "mlp.shared_expert.gate_proj.weight", L + "mlp.shared_expert.up_proj.weight"), "gate_up", layers="moe"),
    Rule("mlp.shared_experts.linear_fc2.weight", (L + "mlp.shared_expert.down_proj.weight",), "row", layers="moe"),
    Rule("mlp.shared_experts.gate_weight", (L + "mlp.shared_expert_gate.weight",), "replicated", layers="moe"),
)


def _expert_ffn(hf_config: Any) -> int:
    return int(hf_config.moe_intermediate_size)


def _shared(hf_config: Any) -> int:
    return int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)


def _norm_topk(_hf_config: Any) -> bool:
    return True


FAMILY = Family(
    name="qwen3_5_moe",
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    weight_rules=MODEL_RULES + HYBRID_LAYER + moe_rules("mlp", *_EXPERTS) + _SHARED_EXPERT,
    moe=MoE(block="mlp", expert_names=_EXPERTS, expert_ffn_size=_expert_ffn, norm_topk=_norm_topk,
            shared_expert_size=_shared),
    wrapped=WRAPPED,
    refuse=refuse,
    **HYBRID,
)
