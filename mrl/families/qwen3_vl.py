"""Qwen3-VL dense (``Qwen3VLForConditionalGeneration``): Qwen3's decoder (per-head q/k RMSNorm, no biases) behind
transformers' Qwen3-VL vision tower, with interleaved multimodal RoPE and deepstack.

The checkpoint keeps the decoder under ``model.language_model.*``, ``lm_head.weight`` at the top and the tower under
``model.visual.*``; config.json holds the decoder's fields under ``text_config``, the tower's under
``vision_config``.

Forward (:mod:`mrl.megatron.vision`): the tower's merged patch features replace the image tokens' embeddings, as for
Qwen2.5-VL; 3-D positions follow the same rule for pictures. The rotary frequency ``j`` is rotated by the position of
axis ``j mod 3`` while ``j < 3·mrope_section[axis]`` (else by t): ``mrope_interleaved``. Deepstack: the tower also
returns, per ``vision_config.deepstack_visual_indexes`` entry ``k``, features of an earlier block (its own merger);
those of entry ``k`` are added to the image tokens' hidden states after decoder layer ``k`` (layers 0..K-1, which
must all lie on the first pipeline stage).
"""
from __future__ import annotations

from mrl.families.base import Family, VisionTower, vision_plan_notes
from mrl.families.rules import DENSE_LAYER, MODEL_RULES, QK_NORM

FAMILY = Family(
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    weight_rules=MODEL_RULES + DENSE_LAYER + QK_NORM,
    qk_norm=True,
    plan_notes=vision_plan_notes,
    vision=VisionTower(module="qwen3_vl", model_class="Qwen3VLVisionModel", config_class="Qwen3VLVisionConfig",
                       prefix="model.visual.", decoder_prefix="model.language_model.", mrope="interleaved",
                       deepstack=True),
)
