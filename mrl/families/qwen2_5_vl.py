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


def tower_params(v: dict) -> int:
    """Parameters of transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` for ``vision_config`` ``v``: the patch
    embedding (a bias-free Conv3d), ``depth`` blocks (two RMSNorms, qkv and proj with biases, a gated MLP with
    biases) and the merger (an RMSNorm, then two linears with biases over the ``merge^2`` concatenated patches)."""
    h, i, out, m = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], v.get("spatial_merge_size", 2) ** 2
    patch = v.get("in_chans", v.get("in_channels", 3)) * v.get("temporal_patch_size", 2) * v["patch_size"] ** 2 * h
    block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (3 * h * i + 2 * i + h)
    merger = h + (h * m) ** 2 + h * m + h * m * out + out
    return patch + v["depth"] * block + merger


FAMILY = Family(
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    weight_rules=MODEL_RULES + DENSE_LAYER + QKV_BIAS,
    qkv_bias=True,
    plan_notes=vision_plan_notes,
    vision=VisionTower(module="qwen2_5_vl", model_class="Qwen2_5_VisionTransformerPretrainedModel",
                       config_class="Qwen2_5_VLVisionConfig", prefix="visual.", decoder_prefix="model.",
                       mrope="sections", param_count=tower_params),
)
