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


def tower_params(v: dict) -> int:
    """Parameters of transformers' ``Qwen3VLVisionModel`` for ``vision_config`` ``v``: the patch embedding (a Conv3d
    with bias), the learnt position table, ``depth`` blocks (two LayerNorms, qkv and proj with biases, a two-layer MLP
    with biases), the merger (a LayerNorm, two linears) and one deepstack merger per ``deepstack_visual_indexes``
    entry (its LayerNorm over the ``merge^2`` concatenated patches)."""
    h, i, out, m = v["hidden_size"], v["intermediate_size"], v["out_hidden_size"], v.get("spatial_merge_size", 2) ** 2
    patch = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v["patch_size"] ** 2 * h + h
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (2 * h * i + i + h)
    linears = (h * m) ** 2 + h * m + h * m * out + out
    deep = len(v.get("deepstack_visual_indexes") or [])
    return (patch + v["num_position_embeddings"] * h + v["depth"] * block + 2 * h + linears
            + deep * (2 * h * m + linears))


FAMILY = Family(
    name="qwen3_vl",
    architectures=("Qwen3VLForConditionalGeneration",),
    weight_rules=MODEL_RULES + DENSE_LAYER + QK_NORM,
    qk_norm=True,
    plan_notes=vision_plan_notes,
    vision=VisionTower(module="qwen3_vl", model_class="Qwen3VLVisionModel", config_class="Qwen3VLVisionConfig",
                       prefix="model.visual.", decoder_prefix="model.language_model.", mrope="interleaved",
                       deepstack=True, param_count=tower_params),
)
