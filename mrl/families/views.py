"""The decoder's view of a checkpoint's ``config.json``, for checkpoints that wrap the decoder in a larger model.

Qwen3.5 / Qwen3.6 ship as vision-language models (``Qwen3_5ForConditionalGeneration``): config.json holds the
decoder's fields under ``text_config`` (next to ``vision_config``), the checkpoint holds the decoder's tensors
under ``model.language_model.*`` beside the vision tower's ``model.visual.*`` and a top-level ``lm_head``. mrl
trains the decoder and carries the rest, so everything that reads the model's shape (the provider, the weight
mapping, ``mrl plan``) reads this view: the ``text_config`` fields, with the outer config's ``architectures`` (the
family is found by them), its ``tie_word_embeddings`` where the outer config sets it, and :data:`WRAPPED` set to
the HF prefix of the decoder's ``model.`` tensors. A config without ``text_config`` is its own view (unchanged).
"""
from __future__ import annotations

import copy
from typing import Any

WRAPPED = "mrl_decoder_prefix"
"""Attribute / key of a view whose decoder tensors live under a prefix (the value) instead of ``model.``."""

_OUTER_KEYS = ("architectures", "tie_word_embeddings", "image_token_id", "video_token_id", "vision_start_token_id",
               "vision_end_token_id")
VISION = "mrl_vision_config"
"""Attribute / key of a view holding the outer config's ``vision_config`` as a dict (the families whose vision tower
mrl builds read it: :mod:`mrl.megatron.vision`)."""


DECODER_PREFIXES: dict[str, str] = {}
"""Architecture -> where its checkpoint keeps the decoder's ``model.*`` tensors, for the families with a vision tower
(``VisionTower.decoder_prefix``; filled by :mod:`mrl.families` as it registers them). Others: ``model.language_model.``."""


def _prefix_of(architectures: Any) -> str:
    for arch in architectures or ():
        if arch in DECODER_PREFIXES:
            return DECODER_PREFIXES[arch]
    return "model.language_model."


def decoder_prefix(hf_config: Any) -> str | None:
    """``model.language_model.`` for a view of a wrapped checkpoint, None for a plain decoder config."""
    if isinstance(hf_config, dict):
        return hf_config.get(WRAPPED)
    return getattr(hf_config, WRAPPED, None)


def decoder_config(hf_config: Any, prefix: str | None = None) -> Any:
    """The decoder view of a transformers config (module docstring); ``hf_config`` itself when it has no
    ``text_config``. ``prefix`` None: the family's (:func:`_prefix_of`)."""
    text = getattr(hf_config, "text_config", None)
    if text is None or getattr(hf_config, "vision_config", None) is None:
        return hf_config
    view = copy.deepcopy(text)
    outer = hf_config.to_dict()
    for key in _OUTER_KEYS:
        if key in outer:
            setattr(view, key, getattr(hf_config, key))
    setattr(view, WRAPPED, prefix or _prefix_of(getattr(hf_config, "architectures", None)))
    setattr(view, VISION, hf_config.vision_config.to_dict())
    return view


def decoder_dict(cfg: dict[str, Any], prefix: str | None = None) -> dict[str, Any]:
    """:func:`decoder_config` for a parsed config.json (plain json, no transformers)."""
    text = cfg.get("text_config")
    if "vision_config" not in cfg:
        return cfg
    if not isinstance(text, dict):  # a release with the decoder's fields at the top level (Qwen2.5-VL's config.json)
        text = {k: v for k, v in cfg.items() if k != "vision_config"}
    view = dict(text)
    for key in _OUTER_KEYS:
        if key in cfg:
            view[key] = cfg[key]
    view[WRAPPED] = prefix or _prefix_of(cfg.get("architectures"))
    view[VISION] = cfg["vision_config"]
    return view
