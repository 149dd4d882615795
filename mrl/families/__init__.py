"""Model families: one module per family declares everything mrl needs to train and serve it.

Each module (``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``qwen3_moe``, ``qwen2_moe``, ``mixtral``,
``deepseek_v3``, ``glm4_moe``, ``gpt_oss``, the hybrid-attention ``qwen3_5``, ``qwen3_5_moe`` and ``qwen3_next``, the
vision-language ``qwen2_5_vl``, ``qwen3_vl`` and ``qwen3_vl_moe``, the sparse-attention ``deepseek_v32`` and ``glm_moe_dsa``)
defines ``FAMILY``, a :class:`~mrl.families.base.Family`: the HF architectures it owns, its
config.json → Megatron facts (qkv bias, q/k norm, sliding window, MoE router and experts), its layer-spec
needs, its HF ↔ Megatron weight rules and what it refuses. This registry builds the lookups the rest of
mrl asks (:mod:`mrl.megatron.provider`, :mod:`mrl.megatron.mapping`, :mod:`mrl.megatron.moe`, the
engine's :mod:`~mrl.rollout.engine.decode` and :mod:`~mrl.rollout.engine.moe`, ``mrl plan``'s
checkpoint preflight). Torch-free and outside :mod:`mrl.megatron`, so the config layer and the rollout
engine read it without the model stack.

Adding a family: a new module with its ``FAMILY``, its name in :data:`_MODULES`, and its tests
(docs/megatron.md, "Adding a model family").
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

from mrl.families.base import Family, MoE
from mrl.families.refused import REFUSED_ARCHITECTURES
from mrl.families.views import DECODER_PREFIXES

_MODULES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3",
            "glm4_moe", "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_next",
            "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "deepseek_v32", "glm_moe_dsa")

FAMILIES: dict[str, Family] = {}
for _mod in _MODULES:
    _fam = import_module(f"mrl.families.{_mod}").FAMILY
    FAMILIES[_fam.name] = _fam

SUPPORTED_ARCHITECTURES: dict[str, str] = {arch: f.name for f in FAMILIES.values() for arch in f.architectures}
"""HF architecture -> family key (what ``mrl plan`` checks a checkpoint's config.json against)."""
for _fam in FAMILIES.values():  # where a vision-language family's checkpoint keeps its decoder (families.views)
    if _fam.vision is not None:
        DECODER_PREFIXES.update(dict.fromkeys(_fam.architectures, _fam.vision.decoder_prefix))


def family_key(model_type: Any) -> str:
    """The family key of a ``model_type``: a vision-language family's decoder config names itself ``<key>_text``
    (Qwen3.5's ``qwen3_5_text``, ``qwen3_5_moe_text``)."""
    return str(model_type).removesuffix("_text")


def family_of(hf_config: Any) -> Family:
    """The family of an HF config (by ``architectures``; a config built in code, without them, by
    ``model_type``), or a ValueError naming the supported architectures or why one is refused."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return FAMILIES[SUPPORTED_ARCHITECTURES[arch]]
        if arch in REFUSED_ARCHITECTURES:
            raise ValueError(f"config.json architectures {archs}: not supported yet: {REFUSED_ARCHITECTURES[arch]}")
    model_type = family_key(getattr(hf_config, "model_type", None))
    if not archs and model_type in FAMILIES:
        return FAMILIES[model_type]
    raise ValueError(
        f"unsupported model architectures {archs} in config.json; mrl supports "
        f"{sorted(SUPPORTED_ARCHITECTURES)}. Convert the checkpoint to one of these, or add a "
        "family module to mrl/families/ (docs/megatron.md, 'Adding a model family')"
    )


__all__ = ["FAMILIES", "REFUSED_ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "Family", "MoE", "family_key", "family_of"]
