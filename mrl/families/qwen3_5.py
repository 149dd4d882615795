"""Qwen3.5 / Qwen3.6 dense (``Qwen3_5ForConditionalGeneration``, text-only ``Qwen3_5ForCausalLM``): a hybrid decoder
of Gated DeltaNet linear-attention layers and gated full-attention layers (3 : 1 in the released sizes).

Every layer: ``h = x + mixer(rmsnorm(x)); y = h + SwiGLU(rmsnorm(h))`` with zero-centred RMSNorms
(``x̂ · (1 + w)``, also the final norm and the attention's q/k norms). The mixer, per ``layer_types``:

* ``linear_attention``: Gated DeltaNet (:mod:`mrl.megatron.gated_delta_net`), HF ``linear_attn.{in_proj_qkv,
  in_proj_z, in_proj_b, in_proj_a, conv1d, A_log, dt_bias, norm, out_proj}``;
* ``full_attention``: GQA attention with per-head q/k norms, RoPE on the first ``partial_rotary_factor`` (0.25)
  of each head, and an output gate: ``q_proj`` yields ``[q_h | g_h]`` per head, ``o = o_proj(attn · sigmoid(g))``
  (Megatron ``attention_output_gate``; the ``qkv_gated`` split of :mod:`mrl.megatron.mapping`).

The released checkpoints are vision-language: the decoder under ``model.language_model.``, the vision tower
(transformers' ``Qwen3_5VisionModel``: Qwen3-VL's tower without deepstack) under ``model.visual.``, built and run on
the first pipeline stage (:mod:`mrl.megatron.vision`; frozen unless ``actor.freeze_vision_tower=false``), ``mtp.*``
multi-token-prediction layers (not part of the causal LM: never read for training, carried on export). Positions
are Qwen3-VL's interleaved mRoPE (``mrope_section``, default [11, 11, 10]) over the rotated quarter of each
full-attention head only (Megatron ``rotary_percent``); the Gated DeltaNet layers take no positions. Text tokens
sit at equal t/h/w positions, i.e. plain RoPE, so a text-only row trains as before. The text-only
``Qwen3_5ForCausalLM`` (no ``vision_config``) builds no tower. Qwen3.5-MoE (:mod:`mrl.families.qwen3_5_moe`) shares
the decoder tables and still carries its tower.
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, LinearAttention, VisionTower, vision_plan_notes
from mrl.families.qwen3_vl import tower_params
from mrl.families.rules import DENSE_MLP, MODEL_RULES, L, Rule
from mrl.families.views import VISION

A = L + "self_attn."
G = L + "linear_attn."


def _gdn_in_proj(hf_config: Any) -> tuple[tuple[int, ...], ...]:
    """Row blocks of HF ``in_proj_qkv`` (q, k, v), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""
    kd = int(hf_config.linear_num_key_heads) * int(hf_config.linear_key_head_dim)
    vd = int(hf_config.linear_num_value_heads) * int(hf_config.linear_value_head_dim)
    nv = int(hf_config.linear_num_value_heads)
    return (kd, kd, vd), (vd,), (nv,), (nv,)


def _gdn_conv(hf_config: Any) -> tuple[tuple[int, ...], ...]:
    return (_gdn_in_proj(hf_config)[0],)


NORMS = (
    Rule("input_layernorm.weight", (L + "input_layernorm.weight",), "replicated"),
    Rule("pre_mlp_layernorm.weight", (L + "post_attention_layernorm.weight",), "replicated"),
)
GATED_ATTENTION = (
    Rule("self_attention.linear_qkv.weight", (A + "q_proj.weight", A + "k_proj.weight", A + "v_proj.weight"),
         "qkv_gated", mixer="attention"),
    Rule("self_attention.linear_proj.weight", (A + "o_proj.weight",), "row", mixer="attention"),
    Rule("self_attention.q_layernorm.weight", (A + "q_norm.weight",), "replicated", mixer="attention"),
    Rule("self_attention.k_layernorm.weight", (A + "k_norm.weight",), "replicated", mixer="attention"),
)
GATED_DELTA_NET = (
    Rule("self_attention.in_proj.weight", (G + "in_proj_qkv.weight", G + "in_proj_z.weight", G + "in_proj_b.weight",
                                           G + "in_proj_a.weight"), "sections", mixer="linear", sections=_gdn_in_proj),
    Rule("self_attention.conv1d_weight", (G + "conv1d.weight",), "sections", mixer="linear", sections=_gdn_conv),
    Rule("self_attention.A_log", (G + "A_log",), "column", mixer="linear"),
    Rule("self_attention.dt_bias", (G + "dt_bias",), "column", mixer="linear"),
    Rule("self_attention.norm.weight", (G + "norm.weight",), "replicated", mixer="linear"),
    Rule("self_attention.out_proj.weight", (G + "out_proj.weight",), "row", mixer="linear"),
)
HYBRID_LAYER = NORMS + GATED_ATTENTION + GATED_DELTA_NET
WRAPPED = ("model.visual.", "mtp.")  # carried untouched where the tower is not run (Qwen3.5-MoE)


def plan_notes(hf_config: Any) -> list[str]:
    """What ``mrl plan`` says about a Qwen3.5-family checkpoint."""
    pattern = LinearAttention().pattern(hf_config)
    notes = [(f"hybrid attention: {sum(pattern)} Gated DeltaNet + {len(pattern) - sum(pattern)} gated full-attention "
             "layers; the Gated DeltaNet layers keep no KV cache (state per sequence, restarted per packed sequence)")]
    mtp = int(getattr(hf_config, "mtp_num_hidden_layers", 0) or 0)
    if mtp:
        notes.append(f"{mtp} multi-token-prediction layer(s) (mtp.*) are not trained (not part of the causal LM); "
                     "exports carry them unchanged")
    return notes


def plan_notes_with_tower(hf_config: Any) -> list[str]:
    """The hybrid notes, plus the tower's for a vision-language checkpoint."""
    has_tower = getattr(hf_config, VISION, None) is not None
    return plan_notes(hf_config) + (vision_plan_notes(hf_config) if has_tower else [])


def refuse(hf_config: Any) -> None:
    if getattr(hf_config, "attention_bias", False):
        raise ValueError("config.json attention_bias=true: Qwen3.5's attention has no biases in mrl's tables")


# what the hybrid families (this one, qwen3_5_moe, qwen3_next) declare alike
HYBRID = {"qk_norm": True, "linear_attention": LinearAttention(), "attention_output_gate": True,
          "zero_centered_norm": True, "plan_notes": plan_notes}

FAMILY = Family(
    name="qwen3_5",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    weight_rules=MODEL_RULES + HYBRID_LAYER + DENSE_MLP,
    wrapped=("mtp.",),
    refuse=refuse,
    **{**HYBRID, "plan_notes": plan_notes_with_tower},
    # Qwen3-VL's tower without deepstack: qwen3_vl.tower_params counts it (no deepstack_visual_indexes)
    vision=VisionTower(module="qwen3_5", model_class="Qwen3_5VisionModel", config_class="Qwen3_5VisionConfig",
                       mrope="interleaved", mrope_default=(11, 11, 10), param_count=tower_params),
)
