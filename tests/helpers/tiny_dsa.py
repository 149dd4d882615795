"""Tiny DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``) checkpoints built from
transformers' config classes (no downloads): 4 layers (layer 0 dense), hidden 32, 4 MLA heads (q_lora_rank 16,
kv_lora_rank 16, nope 8 + rope 4 dims, values 8), 8 routed experts (top-2) and a shared expert, and a lightning
indexer of 8 heads × 8 dims keeping ``index_topk`` = 4 tokens, so rows of 12–24 tokens are sparse. DeepSeek-V3.2
runs YaRN (the indexer's rotation carries its attention factor), GLM-5 plain RoPE. Every weight is redrawn.

:func:`reference` gives transformers' float64 logits (the truth), the deviation of transformers' own float32
forward from them (the float32 scale of these numerics) and the smallest gap, relative to the row's largest score,
between the k-th and (k+1)-th index score over every query with more than k keys (recomputed here from the
indexer's inputs and checked against transformers' own top-k): the selection is stable under float32 rounding
iff that gap is far above it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

TOPK = 4
COMMON = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
          "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
          "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "v_head_dim": 8, "qk_nope_head_dim": 8,
          "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 128,
          "index_topk": TOPK, "index_head_dim": 8, "index_n_heads": 8, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
ARCHS = {"deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig"}


def dsa_config(kind: str, **overrides):
    import transformers as tf

    kw = dict(COMMON)
    if kind == "deepseek_v32":
        kw["rope_parameters"] = YARN
    kw.update(overrides)
    return getattr(tf, ARCHS[kind])(**kw)


def make_tiny_dsa_hf(path: str | os.PathLike, kind: str, *, seed: int = 0, **overrides) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(dsa_config(kind, **overrides), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("mlp.gate.weight") or ".indexer." in name:
                p.copy_(0.5 * noise)  # routers and the indexer: choices well apart
            else:
                p.copy_(0.1 * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    path = Path(path)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def _index_scores(ix, args: tuple, kwargs: dict) -> torch.Tensor:
    """transformers' index scores of one indexer call ``[B, S, T]`` (causal -inf), from its inputs."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    names = ("hidden_states", "q_resid", "position_embeddings", "attention_mask")
    x, qr, (cos, sin), mask = (kwargs[n] if n in kwargs else args[i] for i, n in enumerate(names))
    b, s, _ = x.shape
    r = ix.qk_rope_head_dim
    q = ix.wq_b(qr).view(b, s, ix.n_heads, ix.head_dim)
    k = ix.k_norm(ix.wk(x))[:, :, None]
    rope = apply_rotary_pos_emb_interleave if isinstance(ix, GlmMoeDsaIndexer) else apply_rotary_pos_emb
    qr_, kr_ = rope(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([qr_, q[..., r:]], -1), torch.cat([kr_, k[..., r:]], -1)[:, :, 0]
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.head_dim ** -0.5)
    w = ix.weights_proj(x) * ix.n_heads ** -0.5
    index = torch.einsum("bsh,bsht->bst", w, scores)
    keep = mask if mask.dtype == torch.bool else mask == 0
    return index.masked_fill(~keep, float("-inf"))


def reference(path: str | os.PathLike, ids: torch.Tensor | list[torch.Tensor]) -> dict | list[dict]:
    """{"logits": float64 [B, S, V], "err32": transformers' own float32 max deviation, "gap": the smallest relative
    k-th/(k+1)-th index-score gap of the float64 forward}; a list of such for a list of ``ids`` (one model load)."""
    import copy

    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                    experts_implementation="eager").eval()
    wide = copy.deepcopy(model).double()
    return [_reference(model, wide, x) for x in ids] if isinstance(ids, list) else _reference(model, wide, ids)


def _reference(model, wide, ids: torch.Tensor) -> dict:
    """``model`` in float32, ``wide`` the same weights in float64."""
    with torch.no_grad():
        fp32 = model(input_ids=ids).logits.double()
        model = wide
        gaps: list[float] = []

        def hook(mod, args, kwargs, out):
            index = _index_scores(mod, args, kwargs)
            k = min(mod.index_topk, index.shape[-1])
            assert torch.equal(index.topk(k, -1).indices.sort(-1).values, out.long().sort(-1).values)
            valid = torch.isfinite(index).sum(-1) > k  # queries that have keys to leave out
            if not valid.any():  # the top-k keeps every key of every query: no selection to be unstable
                gaps.append(float("inf"))
                return
            top = index.topk(k + 1, -1).values
            rel = (top[..., k - 1] - top[..., k]) / top[..., 0].abs().clamp_min(1e-30)
            gaps.append(rel[valid].min().item())

        handles = [m.register_forward_hook(hook, with_kwargs=True) for n, m in model.named_modules()
                   if n.endswith("self_attn.indexer")]
        fp64 = model(input_ids=ids).logits
        for h in handles:
            h.remove()
    return {"logits": fp64, "err32": (fp32 - fp64).abs().max().item(), "gap": min(gaps)}
