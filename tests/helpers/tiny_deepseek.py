"""Tiny DeepSeek-V3 checkpoints (``DeepseekV3ForCausalLM``, transformers' own code; no downloads).

4 layers (layer 0 dense: ``first_k_dense_replace=1``), hidden 32, 4 heads of MLA (q_lora_rank 16 or none,
kv_lora_rank 16, nope 8 + rope 4 query/key dims, value 8), YaRN RoPE (factor 4, mscale 1, mscale_all_dim 0.8:
cos/sin and the softmax scale both differ from plain RoPE), 8 routed experts in 4 groups (top-2 groups, top-4
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
          "n_routed_experts": 8, "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 16 if q_lora else None,
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
