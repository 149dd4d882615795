"""Tiny DeepSeek-V3 checkpoints (``DeepseekV3ForCausalLM``, transformers' own code; no downloads).

4 layers (layer 0 dense: ``first_k_dense_replace=1``), hidden 32, 4 heads of MLA (q_lora_rank 16 or none,
kv_lora_rank 16, nope 8 + rope 4 query/key dims, value 8), YaRN RoPE (factor 4, mscale 1, mscale_all_dim 0.8:
cos/sin and the softmax scale both differ from plain RoPE), 16 routed experts in 4 groups (top-2 groups, top-4
experts: transformers' and Megatron's group scores agree), routed_scaling_factor 2.5, one ungated shared
expert. Every weight and the router's ``e_score_correction_bias`` (a buffer transformers initialises to 0)
are random, the router's large enough that the bias moves the choice off the top sigmoid scores.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch


def deepseek_config(q_lora: bool = True, **overrides):
    import transformers as tf

    kw = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
          "n_routed_experts": 16, "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 16 if q_lora else None,
          "qk_rope_head_dim": 4, "v_head_dim": 8, "qk_nope_head_dim": 8, "n_group": 4, "topk_group": 2,
          "num_experts_per_tok": 4, "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 128,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8,
                              "beta_fast": 32, "beta_slow": 1},
          "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    kw.update(overrides)
    return tf.DeepseekV3Config(**kw)


def build_tiny_deepseek(seed: int = 0, q_lora: bool = True, **overrides) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(deepseek_config(q_lora, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model.eval()


def make_tiny_deepseek_hf(path: str | os.PathLike, seed: int = 0, q_lora: bool = True, **overrides) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_deepseek(seed, q_lora, **overrides).save_pretrained(path, safe_serialization=True)
    return path


def reference_routing(model, ids: torch.Tensor, bias_shift: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``[B, S, layers, top_k]`` (sorted per token; 0 on the dense layers): DeepSeek-V3's expert choice
    computed here from the router logits transformers reports (``output_router_logits``), not by its router:
    ``s = sigmoid(l) + e_score_correction_bias (+ bias_shift)``, the ``topk_group`` groups with the largest
    top-2 sums, the top-k of ``s`` inside them."""
    cfg = model.config
    b, t = ids.shape
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    moe = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    ref = torch.zeros(b * t, len(model.model.layers), cfg.num_experts_per_tok, dtype=torch.int32)
    for i, logits in zip(moe, out.router_logits, strict=True):
        s = torch.sigmoid(logits.float()) + model.model.layers[i].mlp.gate.e_score_correction_bias
        if bias_shift is not None:
            s = s + bias_shift
        groups = s.view(b * t, cfg.n_group, -1)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, group_score.topk(cfg.topk_group).indices, True)
        masked = s.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
        ref[:, i] = masked.topk(cfg.num_experts_per_tok).indices.sort(-1).values.to(torch.int32)
    return ref.view(b, t, len(model.model.layers), -1)
