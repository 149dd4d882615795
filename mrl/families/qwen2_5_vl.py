"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2's decoder (q/k/v biases) behind transformers' Qwen2.5-VL
vision tower, with multimodal RoPE in sections.

The checkpoint keeps the released layout: the decoder under ``model.*`` (``model.layers.{i}...``, ``model.embed_tokens``,
``model.norm``), ``lm_head.weight``, the tower under ``visual.*``; config.json holds the decoder's fields under
``text_config`` (read through :func:`mrl.families.views.decoder_config`) and the tower's under ``vision_config``.

Forward (:mod:`mrl.megatron.vision`): ``e = embed(ids)``; the rows of ``e`` at the ``image_token_id`` tokens become, in
order, the tower's merged patch features of the sample's pictures; the decoder then runs Qwen2's layers with RoPE at
3-D positions (t, h, w): text tokens at ``(p, p, p)``, an image's ``(h', w')`` grid of merged patches at
``(s, s + r, s + c)`` after a text run ending at ``s − 1``, the next text at ``s + max(h', w')``. The rotary
frequencies split in ``mrope_section = [t, h, w]`` consecutive groups, each rotated by its axis' position.
"""
from __future__ import annotations

from mrl.families.base import Family, VisionTower, vision_plan_notes
from mrl.families.rules import DENSE_LAYER, MODEL_RULES, QKV_BIAS

FAMILY = Family(
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    weight_rules=MODEL_RULES + DENSE_LAYER + QKV_BIAS,
    qkv_bias=True,
    plan_notes=vision_plan_notes,
    vision=VisionTower(module="qwen2_5_vl", model_class="Qwen2_5_VisionTransformerPretrainedModel",
                       config_class="Qwen2_5_VLVisionConfig", prefix="visual.", decoder_prefix="model.",
                       mrope="sections"),
)
