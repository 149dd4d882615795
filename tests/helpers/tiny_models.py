"""Tiny Hugging Face checkpoints built from configs (no downloads), shared by the tests.

``make_tiny_hf(path, family)`` writes config.json, model.safetensors and a tokenizer into
``path`` and returns it. Families: llama (GQA, untied), qwen2 (qkv bias, tied embeddings,
vocab not a multiple of 4*TP), qwen3 (q/k norm), mistral; MoE: qwen3_moe (4 experts, top-2,
normalised top-k), qwen2_moe (un-normalised top-k, shared expert with its gate), mixtral, gpt_oss (attention
sinks, alternating 5-token windows and full layers, YaRN RoPE, biased router and experts with a clamp low enough
to bite), deepseek_v3 (MLA, sigmoid router), glm4_moe (GLM-4.5: partial RoPE, sigmoid router with a
score-correction bias, ungated shared expert). Weights are random with a fixed seed
and scaled so that logits are O(1) (useful for parity tests in fp32).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

VOCAB = 300  # not a multiple of 128 nor of 8 (=4*TP2): exercises vocab padding

_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# Qwen3-VL's (and Qwen3-VL-MoE's) tiny tower and decoder RoPE: 3-D positions, interleaved sections
QWEN3_VL_TOWER = {"depth": 1, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2, "intermediate_size": 64,
                  "deepstack_visual_indexes": [0]}
QWEN3_VL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}


def hf_config(family: str, **overrides):
    import transformers as tf

    kw = dict(_COMMON)
    if family == "llama":
        cls = tf.LlamaConfig
        kw.update(tie_word_embeddings=False)
    elif family == "qwen2":
        cls = tf.Qwen2Config
        kw.update(tie_word_embeddings=True)
    elif family == "qwen3":
        cls = tf.Qwen3Config
        kw.update(tie_word_embeddings=False, head_dim=16)
    elif family == "mistral":
        cls = tf.MistralConfig
        kw.update(tie_word_embeddings=False, sliding_window=None)
    elif family == "qwen3_moe":
        cls = tf.Qwen3MoeConfig
        kw.update(tie_word_embeddings=False, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  router_aux_loss_coef=0.01)
    elif family == "qwen2_moe":
        cls = tf.Qwen2MoeConfig
        kw.update(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                  shared_expert_intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=1,
                  mlp_only_layers=[], use_sliding_window=False, router_aux_loss_coef=0.01)
    elif family == "mixtral":
        cls = tf.MixtralConfig
        kw.update(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                  sliding_window=None, router_aux_loss_coef=0.01)
    elif family == "gpt_oss":
        cls = tf.GptOssConfig
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64}
        kw.update(tie_word_embeddings=False, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                  intermediate_size=48, sliding_window=5, swiglu_limit=0.4, router_aux_loss_coef=0.01,
                  rope_parameters=rope, attention_bias=True)
        kw.pop("rope_theta")
    elif family == "deepseek_v3":  # every layer MoE here; tests/helpers/tiny_deepseek.py has the parity model
        cls = tf.DeepseekV3Config
        kw.update(tie_word_embeddings=False, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=48, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
                  kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
    elif family == "glm4_moe":
        # GLM-4.5's pieces: partial RoPE, qkv bias, q/k norm, sigmoid router with a score-correction bias (set
        # non-zero by build_tiny_model), routed_scaling_factor, an ungated shared expert; all layers MoE here
        cls = tf.Glm4MoeConfig
        kw.update(tie_word_embeddings=False, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
                  use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                  n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=2.5)
    elif family == "qwen3_next":
        cls = tf.Qwen3NextConfig
        kw.update(tie_word_embeddings=False, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"][
                      : _COMMON["num_hidden_layers"]],
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        kw.pop("rope_theta", None)
    elif family in ("qwen3_5", "qwen3_5_moe"):
        # the decoder's config (text-only form); tests/helpers/tiny_qwen3_5.py builds the vision-language checkpoints
        moe = family == "qwen3_5_moe"
        cls = tf.Qwen3_5MoeTextConfig if moe else tf.Qwen3_5TextConfig
        kw.update(tie_word_embeddings=False, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"][
                      : _COMMON["num_hidden_layers"]],
                  architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"])
        kw.pop("rope_theta", None)
        if moe:
            kw.pop("intermediate_size", None)
            kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96)
    elif family == "qwen2_5_vl":  # the decoder's view of a vision-language config (mrl.families.views)
        from mrl.families.views import decoder_config

        kw.pop("rope_theta", None)
        text = {**kw, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
                **overrides}
        cfg = tf.Qwen2_5_VLConfig(text_config=text, vision_config={"depth": 1, "hidden_size": 32, "out_hidden_size": 64,
                                                                   "num_heads": 2, "intermediate_size": 64})
        cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
        return decoder_config(cfg)
    elif family == "qwen3_vl":
        from mrl.families.views import decoder_config

        kw.pop("rope_theta", None)
        text = {**kw, "head_dim": 16, "rope_parameters": copy.deepcopy(QWEN3_VL_ROPE), **overrides}
        cfg = tf.Qwen3VLConfig(text_config=text, vision_config=copy.deepcopy(QWEN3_VL_TOWER))
        cfg.architectures = ["Qwen3VLForConditionalGeneration"]
        return decoder_config(cfg)
    elif family in ("deepseek_v32", "glm_moe_dsa"):  # every layer MoE here; tests/helpers/tiny_dsa.py: the parity model
        cls = tf.DeepseekV32Config if family == "deepseek_v32" else tf.GlmMoeDsaConfig
        kw.update(tie_word_embeddings=False, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=48, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=0,
                  kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
                  index_topk=4, index_head_dim=16, index_n_heads=4)
    elif family == "qwen3_vl_moe":  # Qwen3-VL's tower before a Qwen3-MoE decoder (4 experts, top-2)
        from mrl.families.views import decoder_config

        kw.pop("rope_theta", None)
        kw.pop("intermediate_size", None)
        text = {**kw, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                "norm_topk_prob": True, "rope_parameters": copy.deepcopy(QWEN3_VL_ROPE), **overrides}
        cfg = tf.Qwen3VLMoeConfig(text_config=text, vision_config=copy.deepcopy(QWEN3_VL_TOWER))
        cfg.architectures = ["Qwen3VLMoeForConditionalGeneration"]
        return decoder_config(cfg)
    else:
        raise ValueError(f"unknown tiny family {family!r}")
    kw.update(overrides)
    return cls(**kw)


def build_tiny_model(family: str, seed: int = 0, **overrides):
    import transformers as tf

    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                # Norm weights around 1, biases small and non-zero so bias mapping is tested.
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith(("sinks", "router.bias")):  # O(1): they change the result
                    p.copy_(torch.randn_like(p))
                else:
                    p.copy_(0.05 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a sigmoid router's bias: large enough to change the top-k
                b.copy_(0.2 * torch.randn_like(b))
    model.eval()
    return model


def make_tiny_hf(path: str | os.PathLike, family: str = "qwen2", seed: int = 0, **overrides) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(family, seed=seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path)
    return path
