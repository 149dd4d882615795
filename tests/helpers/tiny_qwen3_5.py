"""Tiny Qwen3.5-family checkpoints (hybrid Gated DeltaNet + gated attention) built from configs, saved as transformers
saves them: the released vision-language form (``Qwen3_5ForConditionalGeneration``, ``...MoeForConditionalGeneration``:
decoder under ``model.language_model.``, a one-block vision tower under ``model.visual.``) or the text-only form
(``Qwen3_5ForCausalLM``). Every parameter is redrawn (transformers initialises the zero-centred norms to 0, the gated
norm to 1 and the conv as a copy: a fault in any of them could hide behind those values)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

# layer 2 is the only full-attention layer: PP2 puts a stage boundary between a linear and a full layer
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
TEXT = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "max_position_embeddings": 512, "layer_types": LAYER_TYPES,
            "rms_norm_eps": 1e-6}
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if ("norm" in name or name.endswith(("A_log", "dt_bias"))) else 0.08
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def make_tiny_qwen3_next_hf(path: str | os.PathLike, *, seed: int = 0, **overrides) -> Path:
    """A tiny ``Qwen3NextForCausalLM`` (all layers MoE with a gated shared expert; grouped Gated DeltaNet projections)."""
    import transformers as tf

    cfg = tf.Qwen3NextConfig(**{**TEXT, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 96, **overrides})
    torch.manual_seed(seed)
    model = tf.Qwen3NextForCausalLM(cfg).eval()
    _redraw(model, seed)
    model.save_pretrained(str(path))
    return Path(path)


def make_tiny_qwen3_5_hf(path: str | os.PathLike, *, moe: bool = False, wrapped: bool = True, seed: int = 0,
                         **text_overrides) -> Path:
    import transformers as tf

    text = {**TEXT, **text_overrides}
    if moe:
        text = {**text, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "num_experts": 4,
                "num_experts_per_tok": 2}
    else:
        text = {**text, "intermediate_size": 96}
    if wrapped:
        cfg_cls = tf.Qwen3_5MoeConfig if moe else tf.Qwen3_5Config
        model_cls = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
        cfg = cfg_cls(text_config=text, vision_config=VISION)
    else:
        cfg_cls = tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig
        model_cls = tf.Qwen3_5MoeForCausalLM if moe else tf.Qwen3_5ForCausalLM
        cfg = cfg_cls(**text)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    _redraw(model, seed)
    model.save_pretrained(str(path))
    return Path(path)


def reference_logits(path: str | os.PathLike, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(transformers' float64 logits of ``ids`` [B, T] from the checkpoint's own architecture, the max deviation of
    transformers' own float32 forward from them): the truth, and the float32 error of the same maths on this host,
    which bounds what any float32 implementation can be expected to reach (the delta rule's triangular solves make
    it ~1e-5 at logits of ~3 for these weights)."""
    import json

    import transformers as tf

    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    # the eager expert loop: the grouped-GEMM one has no float64 kernel
    model = getattr(tf, arch).from_pretrained(str(path), dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():
        fp32 = model(input_ids=ids).logits.double()
        fp64 = model.double()(input_ids=ids).logits
    return fp64, (fp32 - fp64).abs().max().item()
