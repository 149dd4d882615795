"""gpt-oss (``GptOssForCausalLM``): an MoE decoder with attention sinks, alternating sliding-window and full
layers, biases on every linear and clamped-SwiGLU experts.

What transformers 5 computes (``modeling_gpt_oss.py``) and the Megatron settings that compute the same:

* **Attention**: q/k/v/o projections with biases (``attention_bias``: Megatron ``add_bias_linear``, which also
  gives the router and the experts their biases: gpt-oss has them all); one learnable sink logit per head
  (``self_attn.sinks``) in every softmax denominator: ``softmax_type="learnable"``, held as
  ``core_attention.softmax_offset`` (mrl's SDPA core attention implements it, :mod:`mrl.megatron.sdpa_attention`).
* **Windows**: ``layer_types[i] == "sliding_attention"`` windows layer ``i`` to the last ``sliding_window`` keys
  (``q - W < k <= q``): ``window_size=(W - 1, 0)`` with ``window_attn_skip_freq`` the per-layer 1/0 list (1 =
  windowed; the default layer_types alternate sliding, full, sliding, ...).
* **RoPE**: YaRN (``rope_parameters.rope_type="yarn"``), read by the provider for every family
  (Megatron's ``YarnRotaryEmbedding``: same inverse frequencies and attention factor as transformers').
* **Router** (``mlp.router``, weight and bias): top-k over the biased logits, softmax over those k:
  Megatron's softmax router without pre-softmax (``norm_topk``).
* **Experts**: ``(up + 1) · g · sigmoid(1.702 g)`` with ``g = min(gate, limit)``, ``up = clamp(up, ±limit)``
  (``swiglu_limit``), then ``down`` with its bias, times the routing weight (bias included): Megatron's GLU with
  ``activation_func=quick_gelu`` (``x · sigmoid(1.702 x)``), ``glu_linear_offset=1`` and
  ``activation_func_clamp_value=limit``. The checkpoint stores each layer's experts fused, in ``x @ W`` layout
  with gate and up columns interleaved: ``mlp.experts.gate_up_proj [E, H, 2F]`` (+ ``_bias [E, 2F]``),
  ``mlp.experts.down_proj [E, F, H]`` (+ ``_bias [E, H]``): fused expert rules (:mod:`mrl.megatron.mapping`).

Refused, with the fix: MXFP4 checkpoints (``quantization_config.quant_method="mxfp4"``, as openai/gpt-oss-* ship):
mrl trains bf16/fp32 weights; ``swiglu_alpha`` other than Megatron's fixed 1.702; ``attention_bias=false``
(Megatron's biases are all or none); expert tensor parallelism (Megatron's expert biases need ETP=1).
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import Family, MoE
from mrl.families.rules import ATTENTION, MODEL_RULES, QKV_BIAS, L, Rule

_ALPHA = 1.702  # Megatron's quick_gelu gain
_LAYER_TYPES = ("sliding_attention", "full_attention")

_X = L + "mlp.experts."
_RULES = MODEL_RULES + ATTENTION + QKV_BIAS + (
    Rule("self_attention.linear_proj.bias", (L + "self_attn.o_proj.bias",), "replicated"),
    # one sink per head, TP-split along the heads like the query heads
    Rule("self_attention.core_attention.softmax_offset", (L + "self_attn.sinks",), "column"),
    Rule("mlp.router.weight", (L + "mlp.router.weight",), "replicated", layers="moe"),
    Rule("mlp.router.bias", (L + "mlp.router.bias",), "replicated", layers="moe"),
    Rule("mlp.experts.local_experts.{j}.linear_fc1.weight", (_X + "gate_up_proj",), "gate_up_interleaved",
         expert=True, layers="moe", fused=True),
    Rule("mlp.experts.local_experts.{j}.linear_fc1.bias", (_X + "gate_up_proj_bias",), "gate_up_interleaved",
         expert=True, layers="moe", fused=True),
    Rule("mlp.experts.local_experts.{j}.linear_fc2.weight", (_X + "down_proj",), "row_t", expert=True, layers="moe",
         fused=True),
    Rule("mlp.experts.local_experts.{j}.linear_fc2.bias", (_X + "down_proj_bias",), "replicated", expert=True,
         layers="moe", fused=True),
)


def _windowed_layers(hf_config: Any) -> list[int]:
    """1/0 per layer: windowed (``sliding_attention``) or full attention."""
    n = int(hf_config.num_hidden_layers)
    types = list(getattr(hf_config, "layer_types", None) or ["full_attention"] * n)
    odd = sorted({t for t in types if t not in _LAYER_TYPES})
    if len(types) != n or odd:
        raise ValueError(f"config.json layer_types {types}: expected {n} entries, each one of {list(_LAYER_TYPES)}")
    return [int(t == "sliding_attention") for t in types]


def _refuse(hf_config: Any) -> None:
    quant = getattr(hf_config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method is not None:
        raise ValueError(
            f"config.json quantization_config.quant_method={str(method)!r}: mrl trains unquantised (bf16/fp32) "
            "weights; fix: use a bf16 checkpoint, e.g. one dequantised by transformers: "
            "AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
            "dtype=torch.bfloat16).save_pretrained(out) (its config.json then has no quantization_config)")
    alpha = float(getattr(hf_config, "swiglu_alpha", _ALPHA))
    if alpha != _ALPHA:
        raise ValueError(f"config.json swiglu_alpha={alpha}: Megatron's clamped GLU uses quick_gelu, whose gain is "
                         f"fixed at {_ALPHA}; a checkpoint with another alpha is not supported")
    if not getattr(hf_config, "attention_bias", True):
        raise ValueError("config.json attention_bias=false: mrl maps gpt-oss with Megatron's add_bias_linear, which "
                         "gives q/k/v/o, the router and the experts biases together; gpt-oss checkpoints have "
                         "attention_bias=true")
    windowed = _windowed_layers(hf_config)
    if any(windowed) and not getattr(hf_config, "sliding_window", None):
        raise ValueError("config.json layer_types has sliding_attention layers but sliding_window is not set")


def _config_kwargs(hf_config: Any) -> dict[str, Any]:
    # the function Megatron's MLP compares its activation with
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    kw: dict[str, Any] = {
        "add_bias_linear": True,
        "softmax_type": "learnable",
        "activation_func": quick_gelu,
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(hf_config.swiglu_limit),
    }
    windowed = _windowed_layers(hf_config)
    if any(windowed):
        # transformers: key k is seen by query q iff q - W < k <= q on a sliding layer
        kw["window_size"] = (int(hf_config.sliding_window) - 1, 0)
        kw["window_attn_skip_freq"] = windowed  # Megatron: a list entry 1 = this (1-based: i+1) layer windowed
    return kw


FAMILY = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    weight_rules=_RULES,
    qkv_bias=True,
    moe=MoE(block="mlp", expert_names=("gate_up_proj", "gate_up_proj", "down_proj"),
            expert_ffn_size=lambda c: int(c.intermediate_size), norm_topk=lambda _c: True, router="router",
            fused_experts=True, expert_linear_bias=True),
    engine_refuses_sliding_window=True,
    attention_sinks=True,
    refuse=_refuse,
    config_kwargs=_config_kwargs,
)
