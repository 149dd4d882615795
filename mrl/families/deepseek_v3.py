"""DeepSeek-V3 / R1 and Kimi-K2 (``DeepseekV3ForCausalLM``): multi-latent attention, a sigmoid router with a
score-correction bias and group-limited top-k, shared experts, the first ``first_k_dense_replace`` layers dense.

Attention (MLA; Megatron ``MLATransformerConfig`` + ``MLASelfAttention`` on the local spec, core attention
:class:`~mrl.megatron.sdpa_attention.SDPAAttention`, which takes ``d_k != d_v``)::

    c_q = rmsnorm(q_a_proj x)            (q_lora_rank set; else q = q_proj x)
    q   = q_b_proj c_q                   per head [qk_nope_head_dim | qk_rope_head_dim]
    [c_kv | k_pe] = kv_a_proj_with_mqa x ;  [k_nope | v] = kv_b_proj rmsnorm(c_kv)  per head
    q_pe, k_pe rotated by RoPE (YaRN when rope_parameters say so) in DeepSeek's interleaved pair layout
    o = o_proj softmax(scale · q·k) v,   scale = mscale(factor, mscale_all_dim)^2 / sqrt(d_nope + d_rope)

Megatron's MLA de-interleaves the rotary dims (even, odd) and rotates halves: the same numbers as
transformers' ``rope_interleave=true`` (the default, DeepSeek-V3's and Kimi-K2's); ``rope_interleave=false``
is refused. Router (:class:`~mrl.families.base.MoE` fields): ``s = sigmoid(W x)``, the top
``topk_group`` of ``n_group`` groups by their top-2 sums of ``s + e_score_correction_bias``, top-k inside
them, ``w = s / sum(s) · routed_scaling_factor``; ``n_shared_experts`` experts of ``moe_intermediate_size``
form one ungated shared MLP. Weights: ``mlp.gate.e_score_correction_bias`` ↔ the router's ``expert_bias``
buffer (frozen in RL, docs/moe.md). Multi-token-prediction layers (``num_nextn_predict_layers``, stored as
``model.layers.{num_hidden_layers + k}``) are not part of the causal LM: never read on load.
"""
from __future__ import annotations

import math
from typing import Any

from mrl.families.base import Family, MoE
from mrl.families.rules import DENSE_MLP_OF_MIXED, MODEL_RULES, L, Rule, moe_rules

_EXPERTS = ("gate_proj", "up_proj", "down_proj")
A = L + "self_attn."


def _q_lora(hf_config: Any) -> bool:
    return getattr(hf_config, "q_lora_rank", None) is not None


def _no_q_lora(hf_config: Any) -> bool:
    return not _q_lora(hf_config)


# Megatron's local MLA spec: every projection a ColumnParallelLinear (the down projections' outputs are
# gathered over TP right after, so a row split of q_a/kv_a is exact), the up projections split by heads.
MLA_ATTENTION = (
    Rule("input_layernorm.weight", (L + "input_layernorm.weight",), "replicated"),
    Rule("self_attention.linear_q_proj.weight", (A + "q_proj.weight",), "column", when=_no_q_lora),
    Rule("self_attention.linear_q_down_proj.weight", (A + "q_a_proj.weight",), "column", when=_q_lora),
    Rule("self_attention.q_layernorm.weight", (A + "q_a_layernorm.weight",), "replicated", when=_q_lora),
    Rule("self_attention.linear_q_up_proj.weight", (A + "q_b_proj.weight",), "column", when=_q_lora),
    Rule("self_attention.linear_kv_down_proj.weight", (A + "kv_a_proj_with_mqa.weight",), "column"),
    Rule("self_attention.kv_layernorm.weight", (A + "kv_a_layernorm.weight",), "replicated"),
    Rule("self_attention.linear_kv_up_proj.weight", (A + "kv_b_proj.weight",), "column"),
    Rule("self_attention.linear_proj.weight", (A + "o_proj.weight",), "row"),
    Rule("pre_mlp_layernorm.weight", (L + "post_attention_layernorm.weight",), "replicated"),
)
ROUTER_BIAS = (Rule("mlp.router.expert_bias", (L + "mlp.gate.e_score_correction_bias",), "replicated", layers="moe"),)
UNGATED_SHARED_EXPERT = (
    Rule("mlp.shared_experts.linear_fc1.weight",
         (L + "mlp.shared_experts.gate_proj.weight", L + "mlp.shared_experts.up_proj.weight"), "gate_up",
         layers="moe"),
    Rule("mlp.shared_experts.linear_fc2.weight", (L + "mlp.shared_experts.down_proj.weight",), "row", layers="moe"),
)


def _first_k_dense(hf_config: Any) -> list[int]:
    """transformers' ``DeepseekV3DecoderLayer``: layer ``i`` is MoE iff ``i >= first_k_dense_replace``."""
    k = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    return [int(i >= k) for i in range(int(hf_config.num_hidden_layers))]


def _rope(hf_config: Any) -> dict[str, Any]:
    """(rope_type, ...) of ``rope_parameters`` (transformers 5) or the legacy ``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    if not params.get("rope_type") and legacy:
        params.update(legacy)
        params["rope_type"] = legacy.get("rope_type") or legacy.get("type")
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or "default"
    return params


def _yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_kwargs(hf_config: Any) -> dict[str, Any]:
    """``MLATransformerConfig`` keywords: the latent ranks, head dims and RoPE (plain or YaRN)."""
    rope = _rope(hf_config)
    kw: dict[str, Any] = {
        "q_lora_rank": getattr(hf_config, "q_lora_rank", None),
        "kv_lora_rank": int(hf_config.kv_lora_rank),
        "qk_head_dim": int(hf_config.qk_nope_head_dim),
        "qk_pos_emb_head_dim": int(hf_config.qk_rope_head_dim),
        "v_head_dim": int(hf_config.v_head_dim),
        "rotary_base": float(rope["rope_theta"]),
        "rope_type": "rope",
        # MLA's softmax scale is mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(d): 1 / sqrt(d) here
        "rotary_scaling_factor": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.0,
        "kv_channels": int(hf_config.qk_nope_head_dim) + int(hf_config.qk_rope_head_dim),
    }
    if rope["rope_type"] == "yarn":
        factor = rope.get("factor")
        orig = int(rope.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
        if factor is None:
            factor = hf_config.max_position_embeddings / orig
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        kw.update(rope_type="yarn", rotary_scaling_factor=float(factor), original_max_position_embeddings=orig,
                  beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                  # transformers: cos/sin times mscale(f, mscale)/mscale(f, mscale_all_dim) when both are set,
                  # else mscale(f, 1); Megatron: the ratio, with mscale_all_dim=0 meaning mscale(f, 0) = 1
                  mscale=float(mscale) if (mscale and all_dim) else 1.0,
                  mscale_all_dim=float(all_dim or 0.0))
    return kw


def _refuse(hf_config: Any) -> None:
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        raise ValueError("config.json has a quantization_config (DeepSeek-V3/Kimi-K2 ship block-scaled fp8 weights): "
                         "mrl loads bf16/fp32 tensors; fix: dequantise to bf16 (the model's fp8_cast_bf16.py) and "
                         "remove quantization_config from config.json")
    # keys of DeepSeek's own config class that transformers' DeepseekV3 does not read: it always routes this way
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        got = getattr(hf_config, key, want)
        if got != want:
            raise ValueError(f"config.json {key}={got!r}: DeepseekV3ForCausalLM (transformers and mrl) routes with "
                             f"{key}={want!r}; a checkpoint trained otherwise is not this architecture")
    heads = int(hf_config.num_attention_heads)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if int(kv_heads) != heads:
        raise ValueError(f"config.json num_key_value_heads={kv_heads} != num_attention_heads={heads}: multi-latent "
                         "attention expands keys/values per query head; set num_key_value_heads to num_attention_heads")
    if getattr(hf_config, "rope_interleave", True) is False:
        raise ValueError("config.json rope_interleave=false: Megatron's multi-latent attention rotates DeepSeek's "
                         "interleaved pair layout only; DeepSeek-V3/R1 and Kimi-K2 checkpoints use "
                         "rope_interleave=true (the default): remove the key or set it to true")
    rope = _rope(hf_config)
    if rope["rope_type"] not in ("default", "yarn"):
        raise ValueError(f"config.json rope type {rope['rope_type']!r} with multi-latent attention: supported are "
                         "'default' and 'yarn'")
    if rope["rope_type"] == "yarn":
        if rope.get("truncate", True) is False:
            raise ValueError("config.json rope_parameters.truncate=false: Megatron's MLA YaRN rounds the correction "
                             "range to integers (truncate=true); remove the key")
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if all_dim and not mscale:
            raise ValueError("config.json rope_parameters: mscale_all_dim without mscale gives transformers' and "
                             "Megatron's YaRN different cos/sin scales; set mscale (DeepSeek-V3: 1.0)")
        if rope.get("attention_factor") is not None:
            mk = mla_kwargs(hf_config)
            f = mk["rotary_scaling_factor"]
            ours = _yarn_get_mscale(f, mk["mscale"]) / _yarn_get_mscale(f, mk["mscale_all_dim"])
            if not math.isclose(float(rope["attention_factor"]), ours, rel_tol=1e-9):
                raise ValueError(f"config.json rope_parameters.attention_factor={rope['attention_factor']} differs "
                                 f"from the YaRN factor Megatron derives ({ours}); remove the key")
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("config.json attention_bias=true: Megatron's MLA projections have no biases")


def _expert_ffn(hf_config: Any) -> int:
    return int(hf_config.moe_intermediate_size)


def _shared(hf_config: Any) -> int:
    return int(hf_config.moe_intermediate_size) * int(getattr(hf_config, "n_shared_experts", 0) or 0)


def _norm_topk(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "norm_topk_prob", True))


def _scaling(hf_config: Any) -> float | None:
    v = getattr(hf_config, "routed_scaling_factor", None)
    return None if v is None else float(v)


def mtp_layers(hf_config: Any) -> int:
    """Multi-token-prediction layers a checkpoint may hold after the decoder (skipped on load)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", None) or getattr(hf_config, "num_mtp_layers", 0) or 0)


def _plan_notes(hf_config: Any) -> list[str]:
    notes = [("router score-correction bias (e_score_correction_bias): loaded and frozen during RL "
             "(moe_router_bias_update_rate=0, no aux-loss-free update; docs/moe.md)")]
    n = mtp_layers(hf_config)
    if n:
        first = int(hf_config.num_hidden_layers)
        notes.append(f"multi-token-prediction layers ({n}: model.layers.{first}"
                     f"{'..' + str(first + n - 1) if n > 1 else ''}) in the checkpoint are skipped on load "
                     "(not part of the causal LM; exported checkpoints have none)")
    return notes


FAMILY = Family(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    weight_rules=MODEL_RULES + MLA_ATTENTION + moe_rules("mlp", *_EXPERTS) + ROUTER_BIAS + UNGATED_SHARED_EXPERT
    + DENSE_MLP_OF_MIXED,
    mla=mla_kwargs,
    moe=MoE(block="mlp", expert_names=_EXPERTS, expert_ffn_size=_expert_ffn, norm_topk=_norm_topk,
            shared_expert_size=_shared, layers=_first_k_dense, score_function="sigmoid", expert_bias=True,
            num_groups=lambda c: getattr(c, "n_group", None), group_topk=lambda c: getattr(c, "topk_group", None),
            topk_scaling=_scaling, shared_expert_gate=False),
    refuse=_refuse,
    plan_notes=_plan_notes,
)
