"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (``Glm4MoeForCausalLM``): a GQA decoder with partial RoPE, a sigmoid
router with a score-correction bias, a shared expert without a gate, and dense first layers.

Attention: q/k/v biases when ``attention_bias`` (``qkv_bias_key``), per-head q/k RMSNorm when
``use_qk_norm`` (``qk_norm_key``; GLM-4.5 sets it, GLM-4.5-Air does not), RoPE on the first
``partial_rotary_factor · head_dim`` channels of each head in transformers' half-split (not interleaved)
layout: Megatron's ``rotary_percent`` (read for every family by the provider). MoE layers (transformers'
``Glm4MoeTopkRouter``)::

    s = sigmoid(W_router x)                              [E]
    S = topk(s + b, k)  within the best topk_group of n_group groups (group score: its top-2 sum)
    w_e = routed_scaling_factor · s_e / sum_{j in S} s_j      (norm_topk_prob)
    y = sum_{e in S} w_e · expert_e(x) + shared(x)       (shared: one SwiGLU of n_shared_experts · moe_intermediate_size)

``b`` is ``e_score_correction_bias`` (a buffer: Megatron's router ``expert_bias``, frozen during RL, see
docs/moe.md); the first ``first_k_dense_replace`` layers are dense SwiGLU MLPs of ``intermediate_size``
(``mlp.{gate,up,down}_proj``). Multi-token-prediction layers (``num_nextn_predict_layers``, stored as
``model.layers.{num_hidden_layers + k}``) are not loaded and not exported (transformers ignores them too;
``mrl plan`` says so).
Refused (the sigmoid router's common checks, :class:`~mrl.families.base.MoE`): ``norm_topk_prob=false`` or
top-1 (Megatron renormalises the top-k sigmoid scores exactly when k > 1), group-limited routing whose group
score Megatron computes differently (it sums each group's top ``k / topk_group`` scores, transformers the top 2;
GLM-4.5's ``n_group=1`` has no group restriction).
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, MoE
from mrl.families.deepseek_v3 import ROUTER_BIAS, UNGATED_SHARED_EXPERT
from mrl.families.deepseek_v3 import (
    _plan_notes as _sigmoid_router_notes,  # the bias frozen, MTP layers skipped
)
from mrl.families.rules import (
    ATTENTION,
    DENSE_MLP_OF_MIXED,
    MODEL_RULES,
    QK_NORM,
    QKV_BIAS,
    moe_rules,
)

_EXPERTS = ("gate_proj", "up_proj", "down_proj")


def _expert_ffn(hf_config: Any) -> int:
    return int(hf_config.moe_intermediate_size)


def _shared_expert_size(hf_config: Any) -> int:
    return int(getattr(hf_config, "n_shared_experts", 0) or 0) * int(hf_config.moe_intermediate_size)


def first_dense_layers(hf_config: Any) -> list[int]:
    """Layer ``i`` is an MoE layer iff ``i >= first_k_dense_replace`` (transformers' ``Glm4MoeDecoderLayer``)."""
    k = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    if k < 0:
        raise ValueError(f"config.json first_k_dense_replace={k} must be >= 0")
    return [int(i >= k) for i in range(int(hf_config.num_hidden_layers))]


def _norm_topk(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "norm_topk_prob", True))


def _n_group(hf_config: Any) -> int:
    return int(getattr(hf_config, "n_group", 1) or 1)


def _topk_group(hf_config: Any) -> int:
    return int(getattr(hf_config, "topk_group", 1) or 1)


def _topk_scaling(hf_config: Any) -> float:
    return float(getattr(hf_config, "routed_scaling_factor", 1.0))


FAMILY = Family(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    weight_rules=MODEL_RULES + ATTENTION + QKV_BIAS + QK_NORM + moe_rules("mlp", *_EXPERTS) + ROUTER_BIAS
    + UNGATED_SHARED_EXPERT + DENSE_MLP_OF_MIXED,
    qkv_bias=True,
    qkv_bias_key="attention_bias",
    qk_norm=True,
    qk_norm_key="use_qk_norm",
    moe=MoE(block="mlp", expert_names=_EXPERTS, expert_ffn_size=_expert_ffn, norm_topk=_norm_topk,
            shared_expert_size=_shared_expert_size, layers=first_dense_layers,
            score_function="sigmoid", expert_bias=True, num_groups=_n_group, group_topk=_topk_group,
            topk_scaling=_topk_scaling, shared_expert_gate=False),
    plan_notes=_sigmoid_router_notes,
)
