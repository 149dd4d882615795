"""Tiny hybrid (Gated DeltaNet + gated full attention) Hugging Face checkpoints for the engine's tests.

``make_tiny_hybrid_hf(path, kind)`` writes config.json + model.safetensors (``save_pretrained``: the checkpoint
names, experts per expert) of one of :data:`KINDS`:

* ``qwen3_5``: ``Qwen3_5ForConditionalGeneration`` (the released form: decoder under ``model.language_model.``,
  a 1-block vision tower under ``model.visual.``);
* ``qwen3_5_text``: ``Qwen3_5ForCausalLM`` (the text-only form, ``model.layers.``);
* ``qwen3_5_moe``: ``Qwen3_5MoeForConditionalGeneration`` (4 experts, top-2, gated shared expert);
* ``qwen3_5_moe_text``: ``Qwen3_5MoeForCausalLM`` (its text-only form);
* ``qwen3_next``: ``Qwen3NextForCausalLM`` (MoE with a gated shared expert; fused q/k/v/z and b/a projections).

4 decoder layers, ``layer_types`` linear, linear, linear, full (the 3 : 1 pattern), hidden 64, vocab 300, conv
kernel 4, partial RoPE 0.25. Every parameter is randomised: transformers initialises ``A_log``/``dt_bias``, the
zero-centred norm weights (0 = identity) and the gated norm (1) to values that hide faults (a norm weight of 0
makes the zero-centred and the plain reading differ by nothing visible in a test of one layer); router weights
are scaled so that top-2 choices are well separated (no near-ties between a batched and an unbatched forward).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

KINDS = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
MOE_KINDS = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
LAYERS, NUM_EXPERTS, TOP_K, VOCAB = 4, 4, 2, 300
_TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
             "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
             "max_position_embeddings": 512, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
_MOE = {"num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48}
_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}


def hybrid_config(kind: str, **overrides):
    import transformers as tf

    text = {**_TEXT, **overrides}
    if kind == "qwen3_5":
        return tf.Qwen3_5Config(text_config=text, vision_config=_VISION, tie_word_embeddings=False)
    if kind == "qwen3_5_text":
        return tf.Qwen3_5TextConfig(**text)
    if kind == "qwen3_5_moe":
        return tf.Qwen3_5MoeConfig(text_config={**text, **_MOE}, vision_config=_VISION, tie_word_embeddings=False)
    if kind == "qwen3_5_moe_text":
        return tf.Qwen3_5MoeTextConfig(**text, **_MOE)
    if kind == "qwen3_next":
        return tf.Qwen3NextConfig(**text, **_MOE)
    raise ValueError(f"unknown tiny hybrid kind {kind!r}; one of {KINDS}")


def build_tiny_hybrid(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    import transformers as tf

    cfg = hybrid_config(kind, **overrides)
    torch.manual_seed(seed)
    if kind == "qwen3_5_text":
        model = tf.Qwen3_5ForCausalLM(cfg)
    elif kind == "qwen3_5_moe_text":
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        model = tf.AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    else:
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.05, 0.5)))  # decays exp(g) ~ 0.7-0.97
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "norm" in name:  # zero-centred RMSNorms (1 + w) and the gated norm (w): both away from trivial
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(3.0 * torch.randn_like(p))  # routers: well-separated logits
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn_like(p))
            elif "conv1d" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def make_tiny_hybrid_hf(path: str | os.PathLike, kind: str = "qwen3_5", seed: int = 0, **overrides) -> Path:
    """The checkpoint; a vision-language kind also gets the ``preprocessor_config.json`` a release carries (the
    engine loads a vision-language checkpoint with its image processor)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_hybrid(kind, seed=seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    vision = getattr(model.config, "vision_config", None)
    if vision is not None:
        (path / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor", "patch_size": vision.patch_size,
            "merge_size": vision.spatial_merge_size, "temporal_patch_size": vision.temporal_patch_size,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return path


def decoder_layers(model) -> torch.nn.ModuleList:
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


def reference_topk(model, tokens: list[int]) -> torch.Tensor:
    """The routed-experts oracle: int32 ``[len(tokens), layers, top_k]``, the top-k of softmax(router logits) of each
    layer in one unbatched forward of ``tokens`` (``output_router_logits``)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    layers = decoder_layers(model)
    assert len(out.router_logits) == len(layers)  # every layer of these tiny models is an MoE layer
    ref = torch.zeros(len(tokens), len(layers), TOP_K, dtype=torch.int32)
    for i, logits in enumerate(out.router_logits):
        ref[:, i] = torch.topk(torch.softmax(logits.float(), dim=-1), TOP_K, dim=-1).indices.to(torch.int32)
    return ref
