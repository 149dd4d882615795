"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``, e.g. Qwen3-VL-30B-A3B): Qwen3-MoE's decoder (q/k RMSNorm,
softmax router, top-k renormalised when ``norm_topk_prob``, no shared expert, Qwen's ``mlp_only_layers`` /
``decoder_sparse_step`` for dense layers) behind Qwen3-VL's vision tower (transformers' ``Qwen3VLMoeVisionModel``,
the same blocks, merger and deepstack mergers as ``Qwen3VLVisionModel``), interleaved multimodal RoPE and deepstack
as in :mod:`mrl.families.qwen3_vl`.

Checkpoint layout: the decoder under ``model.language_model.*``, the tower under ``model.visual.*``. Each MoE layer
keeps its experts *fused*, in ``x @ W`` layout (the released Qwen3-VL-30B-A3B / 235B-A22B files, and what SGLang's
``qwen3_vl_moe.py`` loader expects: it transposes, then chunks gate | up)::

    model.language_model.layers.{i}.mlp.experts.gate_up_proj [E, H, 2I]   x @ W[e] = [gate_e(x) | up_e(x)]
    model.language_model.layers.{i}.mlp.experts.down_proj    [E, I, H]
    model.language_model.layers.{i}.mlp.gate.weight          [E, H]       the router

transformers 5's modules hold the transposes (``[E, 2I, H]``, ``[E, H, I]``; its ``conversion_mapping`` transposes
on load when the shapes say so, and its ``save_pretrained`` writes the module layout): the mapping reads either
(splits ``gate_up_t`` / ``row_t``, :mod:`mrl.megatron.mapping`) and writes the released one; the engine names its
modules' tensors by transposed views (:func:`mrl.rollout.engine.moe.checkpoint_views`).
"""
from __future__ import annotations

from typing import Any

from mrl.families.base import (
    Family,
    MoE,
    VisionTower,
    qwen_moe_layers,
    vision_plan_notes,
)
from mrl.families.qwen3_vl import tower_params
from mrl.families.rules import (
    ATTENTION,
    DENSE_MLP_OF_MIXED,
    MODEL_RULES,
    QK_NORM,
    L,
    Rule,
)

_X = L + "mlp.experts."
_EXPERTS = (
    Rule("mlp.router.weight", (L + "mlp.gate.weight",), "replicated", layers="moe"),
    Rule("mlp.experts.local_experts.{j}.linear_fc1.weight", (_X + "gate_up_proj",), "gate_up_t", expert=True,
         layers="moe", fused=True),
    Rule("mlp.experts.local_experts.{j}.linear_fc2.weight", (_X + "down_proj",), "row_t", expert=True,
         layers="moe", fused=True),
)


def _expert_ffn(hf_config: Any) -> int:
    return int(hf_config.moe_intermediate_size)


def _norm_topk(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "norm_topk_prob", False))


FAMILY = Family(
    name="qwen3_vl_moe",
    architectures=("Qwen3VLMoeForConditionalGeneration",),
    weight_rules=MODEL_RULES + ATTENTION + QK_NORM + _EXPERTS + DENSE_MLP_OF_MIXED,
    qk_norm=True,
    plan_notes=vision_plan_notes,
    moe=MoE(block="mlp", expert_names=("gate_up_proj", "gate_up_proj", "down_proj"), expert_ffn_size=_expert_ffn,
            norm_topk=_norm_topk, layers=qwen_moe_layers, fused_experts=True, fused_experts_xw=True),
    vision=VisionTower(module="qwen3_vl_moe", model_class="Qwen3VLMoeVisionModel",
                       config_class="Qwen3VLMoeVisionConfig", prefix="model.visual.",
                       decoder_prefix="model.language_model.", mrope="interleaved", deepstack=True,
                       param_count=tower_params),
)
