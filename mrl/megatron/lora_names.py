"""Names and shapes of the LoRA adapters (:mod:`mrl.megatron.lora`): which Megatron linear fuses which Hugging Face
projections, the HF module of each projection and its peft tensor name (with the decoder prefix of a vision-language
release), the projections a model has, and the HF ``(out, in)`` shape of each (the gated ``q_proj`` of Qwen3.5 twice
as wide; the Gated DeltaNet projections' widths), read off the config alone."""
from __future__ import annotations

from typing import Any

from mrl.megatron.provider import head_dim

# Megatron linear (relative to a TransformerLayer) -> (parallel kind, HF projections it fuses).
# Mixture-of-Experts layers: the shared expert (Qwen2-MoE) is a dense MLP under ``mlp.shared_experts``; the routed
# experts and the router get no adapters (as peft on transformers' fused expert tensors), and a model's dense
# layers (``moe_layer_freq``) have the plain ``mlp.linear_fc*``. A layer holds only the linears it has.
LINEARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    # a hybrid decoder's Gated DeltaNet layers (mrl.megatron.gated_delta_net): Qwen3.5's four input projections
    # (Qwen3-Next's two grouped ones instead: GDN_GROUPED) in one column-parallel in_proj, out_proj row-parallel
    "self_attention.in_proj": ("column", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    "self_attention.out_proj": ("row", ("out_proj",)),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
    "mlp.shared_experts.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.shared_experts.linear_fc2": ("row", ("down_proj",)),
}
GDN_GROUPED = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next's in_proj: [q_g k_g v_g z_g] and [b_g a_g] per key head g
# HF module (under ``model.layers.{i}.``) of a projection adapted through a Megatron linear of LINEARS.
SHARED_EXPERT_HF = "mlp.shared_expert."
HF_MODULE = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
GDN_MODULE = {p: "linear_attn." + p for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                                              *GDN_GROUPED)}
PEFT_PREFIX = "base_model.model."


def hf_module(linear: str, proj: str, shared: str = SHARED_EXPERT_HF) -> str:
    """HF module of projection ``proj`` adapted through Megatron linear ``linear`` (under ``model.layers.{i}.``);
    ``shared``: the family's shared-expert module (:func:`shared_expert_hf`)."""
    if linear.startswith("mlp.shared_experts."):
        return shared + proj
    return HF_MODULE.get(proj) or GDN_MODULE[proj]


def peft_name(layer: int, proj: str, which: str, linear: str = "", shared: str = SHARED_EXPERT_HF,
              decoder: str = "model.") -> str:
    """peft's saved tensor name: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (a shared
    expert's: ``….mlp.shared_expert.gate_proj.lora_A.weight``, GLM-4.5's ``….mlp.shared_experts.…``); ``decoder``:
    the HF prefix of the decoder's layers, ``model.language_model.`` in a vision-language release (Qwen3.5:
    :func:`mrl.families.views.decoder_prefix`), where peft on ``…ForConditionalGeneration`` finds them."""
    return f"{PEFT_PREFIX}{decoder}layers.{layer}.{hf_module(linear, proj, shared)}.lora_{which}.weight"


def decoder_hf_prefix(hf_config: Any) -> str:
    """``model.`` or a wrapped checkpoint's ``model.language_model.`` (:mod:`mrl.families.views`)."""
    from mrl.families.views import decoder_prefix

    return decoder_prefix(hf_config) or "model."


def linear_projs(linear: str, hf_config: Any) -> tuple[str, ...]:
    """The HF projections fused in Megatron linear ``linear`` of this model (Qwen3-Next's grouped GDN input)."""
    from mrl.families import family_of

    if linear == "self_attention.in_proj" and any(r.split == "gdn_grouped" for r in family_of(hf_config).weight_rules):
        return GDN_GROUPED
    return LINEARS[linear][1]


def adapted_targets(targets: tuple[str, ...], hf_config: Any) -> tuple[str, ...]:
    """The names of ``targets`` (``actor.lora.targets``, all-linear expanded to every name mrl adapts) that this model
    has: what its adapters are, what ``lora_config.json`` records and ``adapter_config.json`` lists (a Llama's
    all-linear stays its seven projections; a Qwen3.5 adds its Gated DeltaNet ones)."""
    from mrl.families import family_of

    has = set(HF_MODULE)
    if family_of(hf_config).linear_attention is not None:
        has |= {*linear_projs("self_attention.in_proj", hf_config), "out_proj"}
    return tuple(t for t in targets if t in has)


def gdn_widths(hf_config: Any) -> dict[str, int]:
    """``nk`` key heads, ``r`` value heads per key head, ``dk``, ``dv`` of a Gated DeltaNet layer (whole model)."""
    nk, nv = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
    return {"nk": nk, "r": nv // nk, "dk": int(hf_config.linear_key_head_dim),
            "dv": int(hf_config.linear_value_head_dim)}


def shared_expert_hf(hf_config: Any) -> str:
    """The family's HF shared-expert module under ``model.layers.{i}.``, read off its weight rule (Qwen2-MoE
    ``mlp.shared_expert.``, GLM-4.5 and DeepSeek-V3 ``mlp.shared_experts.``)."""
    from mrl.families import family_of

    for rule in family_of(hf_config).weight_rules:
        if rule.mcore == "mlp.shared_experts.linear_fc1.weight":
            return rule.hf[0].removeprefix("model.layers.{i}.").removesuffix("gate_proj.weight")
    return SHARED_EXPERT_HF


def shared_expert_width(hf_config: Any) -> int:
    """The shared expert's MLP width (the family's ``MoE.shared_expert_size``: Qwen2-MoE's
    ``shared_expert_intermediate_size``, GLM-4.5's ``n_shared_experts · moe_intermediate_size``)."""
    from mrl.families import family_of

    moe = family_of(hf_config).moe
    return int(moe.shared_expert_size(hf_config)) if moe is not None else 0


def proj_shapes(hf_config: Any, ffn: int | None = None) -> dict[str, tuple[int, int]]:
    """HF ``(out, in)`` of every projection; ``ffn``: the MLP's width (None: the dense ``intermediate_size``).
    A gated attention's ``q_proj`` (Qwen3.5) is twice as wide, ``[q_h | g_h]`` per head; a hybrid decoder's Gated
    DeltaNet projections come with their widths."""
    from mrl.families import family_of

    nh = hf_config.num_attention_heads
    ng = getattr(hf_config, "num_key_value_heads", None) or nh
    d, h = head_dim(hf_config), hf_config.hidden_size
    f = ffn or getattr(hf_config, "intermediate_size", None) or 0
    fam = family_of(hf_config)
    shapes = {"q_proj": ((2 if fam.attention_output_gate else 1) * nh * d, h), "k_proj": (ng * d, h),
              "v_proj": (ng * d, h), "o_proj": (h, nh * d), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    if fam.linear_attention is not None:
        w = gdn_widths(hf_config)
        kd, vd, nv = w["nk"] * w["dk"], w["nk"] * w["r"] * w["dv"], w["nk"] * w["r"]
        shapes.update({"in_proj_qkv": (2 * kd + vd, h), "in_proj_z": (vd, h), "in_proj_b": (nv, h),
                       "in_proj_a": (nv, h), "in_proj_qkvz": (2 * kd + 2 * vd, h), "in_proj_ba": (2 * nv, h),
                       "out_proj": (h, vd)})
    return shapes
