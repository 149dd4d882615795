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

_OUTER_KEYS = ("architectures", "tie_word_embeddings")


def decoder_prefix(hf_config: Any) -> str | None:
    """``model.language_model.`` for a view of a wrapped checkpoint, None for a plain decoder config."""
    if isinstance(hf_config, dict):
        return hf_config.get(WRAPPED)
    return getattr(hf_config, WRAPPED, None)


def decoder_config(hf_config: Any, prefix: str = "model.language_model.") -> Any:
    """The decoder view of a transformers config (module docstring); ``hf_config`` itself when it has no
    ``text_config``."""
    text = getattr(hf_config, "text_config", None)
    if text is None or getattr(hf_config, "vision_config", None) is None:
        return hf_config
    view = copy.deepcopy(text)
    for key in _OUTER_KEYS:
        if key in hf_config.to_dict():
            setattr(view, key, getattr(hf_config, key))
    setattr(view, WRAPPED, prefix)
    return view


def decoder_dict(cfg: dict[str, Any], prefix: str = "model.language_model.") -> dict[str, Any]:
    """:func:`decoder_config` for a parsed config.json (plain json, no transformers)."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or "vision_config" not in cfg:
        return cfg
    view = dict(text)
    for key in _OUTER_KEYS:
        if key in cfg:
            view[key] = cfg[key]
    view[WRAPPED] = prefix
    return view
