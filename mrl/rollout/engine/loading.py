"""Loading a checkpoint into the engine under the checkpoint's own tensor names.

The engine answers weight updates, ``/weights_checksum`` and ``/get_weights_by_name`` by the names the
safetensors files hold (what the trainer's weight sync sends, and what SGLang's loaders read). For a
vision-language checkpoint (``config.json`` with a ``vision_config``: Qwen3.5 / Qwen3.6
``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``) those are
``model.language_model.layers.{i}...`` beside ``model.visual...`` and ``lm_head.weight``.
``AutoModelForCausalLM`` builds the text-only class from such a config and renames the decoder to
``model.layers.{i}...`` while it drops the vision tower, so an update by checkpoint name would find no
parameter: we load the ``...ForConditionalGeneration`` class (``AutoModelForImageTextToText``) instead, vision
tower kept (it is part of the served model; a text-only prompt never calls it). Any other checkpoint is a
causal LM (``AutoModelForCausalLM``), whose parameter names are its checkpoint names.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText


def text_config(config):
    """The decoder's config: ``text_config`` of a vision-language config, the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def is_multimodal(config) -> bool:
    """A vision-language checkpoint (its config has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def load_model(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint at ``path`` as a transformers model whose parameter names are the checkpoint's
    (see the module docstring), in ``dtype``, on CPU, not yet in eval mode."""
    config = AutoConfig.from_pretrained(path)
    if not is_multimodal(config):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    try:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    except ValueError as e:  # transformers: "Unrecognized configuration class ... for this kind of AutoModel"
        raise ValueError(f"--model {path}: a vision-language checkpoint (model_type "
                         f"{getattr(config, 'model_type', None)!r}, config.json has vision_config) whose "
                         f"image-text-to-text class transformers does not know ({e}); the engine loads it "
                         f"whole so that weights keep their checkpoint names") from None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers: ``model.model.language_model.layers`` of a vision-language model,
    ``model.model.layers`` otherwise."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers
