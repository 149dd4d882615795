"""HF ↔ Megatron weight rules: the :class:`Rule` record and the building blocks the family modules
assemble their tables from (no torch: :mod:`mrl.megatron.mapping` applies them).

A rule names a Megatron parameter (relative to the ``GPTModel`` for ``scope="model"``, to a
``TransformerLayer`` for ``scope="layer"``), the HF tensor(s) it is made of (``{i}`` the *global* layer
index; for a routed expert ``{j}`` the local and ``{e}`` the global expert index) and how it is split over
TP (ETP for experts); the splits are described in :mod:`mrl.megatron.mapping`. A ``fused`` expert rule names one HF tensor holding all
the layer's experts (transformers' own layout, as gpt-oss checkpoints store them). In a model mixing dense and
MoE layers (:meth:`mrl.families.base.MoE.layer_pattern`) a rule's ``layers`` says which layers have it:
``"all"`` (attention, norms), ``"moe"`` (router, experts, shared expert) or ``"dense"`` (the dense MLP). In a hybrid
decoder (Qwen3.5: Gated DeltaNet and full-attention layers, :class:`mrl.families.base.LinearAttention`) a rule's
``mixer`` says which token mixer has it: ``"all"`` (norms, MLP), ``"attention"`` or ``"linear"``.
A rule's ``when`` (a predicate on config.json) says whether the model has the tensor at all (MLA's
``q_a_proj``/``q_b_proj`` with ``q_lora_rank``, its ``q_proj`` without).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

SPLITS = ("replicated", "column", "row", "vocab", "qkv", "qkv_gated", "gate_up", "gate_up_interleaved", "gate_up_t", "row_t",
          "sections", "gdn_grouped")
LAYER_KINDS = ("all", "moe", "dense")
MIXERS = ("all", "attention", "linear")


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    split: str
    # "model" rules live on the GPTModel (pre/post process stages only), "layer" rules per layer.
    scope: str = "layer"
    # One routed expert's tensor: {j} local / {e} global expert index, split over ETP, spread over EP.
    expert: bool = False
    # Which decoder layers hold it (LAYER_KINDS): every one, MoE layers only or dense-MLP layers only.
    layers: str = "all"
    # An expert rule whose HF tensor holds every expert of the layer stacked along dim 0 (no {e} in the name;
    # gpt-oss): expert e's part is hf[e].
    fused: bool = False
    # Whether config.json gives the model this tensor (None: always), e.g. MLA's q_a_proj only with q_lora_rank.
    when: Callable[[Any], bool] | None = None
    # Which token mixer's layers hold it (MIXERS): every layer's, full-attention layers' or linear-attention layers'.
    mixer: str = "all"
    # split="sections": per HF tensor, the widths of its consecutive row blocks, each split over TP on its own
    # (rank r holds block_0[r] | block_1[r] | ... of every tensor, in order): Gated DeltaNet's [q | k | v] etc.
    sections: Callable[[Any], tuple[tuple[int, ...], ...]] | None = None

    def applies(self, hf_config: Any) -> bool:
        return self.when is None or bool(self.when(hf_config))

    def on_layer(self, moe_layer: bool, linear_layer: bool = False) -> bool:
        """Whether a decoder layer (an MoE layer or not; a linear-attention layer or not) has this rule's parameter."""
        if self.mixer != "all" and (self.mixer == "linear") is not linear_layer:
            return False
        return self.layers == "all" or (self.layers == "moe") is moe_layer

    def with_hf_prefix(self, prefix: str) -> Rule:
        """This rule with ``model.`` in its HF names replaced by ``prefix`` (a vision-language checkpoint keeps its
        decoder under ``model.language_model.``; ``lm_head`` stays where it is)."""
        names = tuple(prefix + n[len("model."):] if n.startswith("model.") else n for n in self.hf)
        return replace(self, hf=names)


EMBED = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "model")
FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", "model")
LM_HEAD = Rule("output_layer.weight", ("lm_head.weight",), "vocab", "model")
MODEL_RULES = (EMBED, FINAL_NORM, LM_HEAD)

L = "model.layers.{i}."
ATTENTION = (
    Rule("input_layernorm.weight", (L + "input_layernorm.weight",), "replicated"),
    Rule(
        "self_attention.linear_qkv.weight",
        (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"),
        "qkv",
    ),
    Rule("self_attention.linear_proj.weight", (L + "self_attn.o_proj.weight",), "row"),
    Rule("pre_mlp_layernorm.weight", (L + "post_attention_layernorm.weight",), "replicated"),
)
DENSE_MLP = (
    Rule("mlp.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"), "gate_up"),
    Rule("mlp.linear_fc2.weight", (L + "mlp.down_proj.weight",), "row"),
)
DENSE_LAYER = ATTENTION + DENSE_MLP
# The dense MLP of the dense layers of an MoE model (Qwen's mlp_only_layers / decoder_sparse_step).
DENSE_MLP_OF_MIXED = tuple(Rule(r.mcore, r.hf, r.split, layers="dense") for r in DENSE_MLP)
QKV_BIAS = (Rule(
    "self_attention.linear_qkv.bias",
    (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"),
    "qkv",
),)
QK_NORM = (
    Rule("self_attention.q_layernorm.weight", (L + "self_attn.q_norm.weight",), "replicated"),
    Rule("self_attention.k_layernorm.weight", (L + "self_attn.k_norm.weight",), "replicated"),
)


def moe_rules(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """Router + routed experts under HF ``model.layers.{i}.<block>``; ``gate/up/down``: one expert's names."""
    x = L + block + ".experts.{e}."
    return (
        Rule("mlp.router.weight", (L + block + ".gate.weight",), "replicated", layers="moe"),
        Rule("mlp.experts.local_experts.{j}.linear_fc1.weight", (x + gate + ".weight", x + up + ".weight"),
             "gate_up", expert=True, layers="moe"),
        Rule("mlp.experts.local_experts.{j}.linear_fc2.weight", (x + down + ".weight",), "row", expert=True,
             layers="moe"),
    )
