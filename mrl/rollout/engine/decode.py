"""One decode step of the running set: ``[B, 1]`` new tokens against the preallocated cache.

Two implementations behind one call, chosen once per model:

* :class:`LlamaFamilyDecoder` for the families the model layer supports (:mod:`mrl.families`: llama,
  qwen2, qwen3, mistral, the MoE ones, without an active sliding window where the family declares
  ``engine_refuses_sliding_window``; not gpt-oss, whose attention sinks it lacks, and not multi-latent attention:
  DeepSeek-V3 runs :func:`hf_decode`): the step is written out over the ``transformers``
  model's own modules (norms, projections, rotary embedding, MLP), so every weight update by HF
  name is seen at once and rope variants (llama3 scaling) come from the model's rotary module.
  What it does differently from calling the model: K/V of the new token go straight into the
  cache column (no concatenation), attention runs over the live columns with the additive padding
  mask (no 4-D mask construction, no K/V repetition for GQA), and the LM head runs in vocabulary chunks
  (on CPU a ``[B, H] @ [H, V]`` GEMM whose weight does not fit in cache runs slower than the same
  work in 1024-row slices; docs/performance.md, 'LM head in vocabulary slices').
* :func:`hf_decode` for any other model: the model's forward with a ``DynamicCache`` built on
  views of the live columns; the new column is copied back into the buffers. Hybrid models (linear-attention
  layers) take :func:`mrl.rollout.engine.hybrid.hybrid_decode`, the same with their recurrent states.

Both give the logits of the transformers forward of the same tokens (fp32: ~1e-6; tested in
``tests/rollout/test_engine_decode.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mrl.families import FAMILIES
from mrl.rollout.engine.kv_cache import RunningBatch

SUPPORTED_TYPES = tuple(FAMILIES)  # every family's model_type (mrl/families/)
LM_HEAD_CHUNK = 1024  # vocabulary rows per LM-head GEMM


def fast_path_refusal(config) -> str | None:
    """Why :class:`LlamaFamilyDecoder` cannot run this config (None = it can)."""
    mt = getattr(config, "model_type", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None) or []
    if "linear_attention" in types:  # checked first: whatever family declares these, the step has no recurrence
        return "hybrid: linear-attention layers keep a conv window and a recurrent state per sequence"
    if getattr(config, "vision_config", None) is not None:
        return f"{mt} is a vision-language model (its decoder sits under model.language_model)"
    if mt not in SUPPORTED_TYPES:
        return f"model_type {mt!r} is not one of {SUPPORTED_TYPES}"
    if FAMILIES[mt].is_mla:
        return f"{mt} multi-latent attention"
    if any(t != "full_attention" for t in types):
        return "sliding-window attention layers"
    if FAMILIES[mt].engine_refuses_sliding_window and getattr(config, "sliding_window", None) is not None:
        return f"{mt} sliding_window is set"
    if FAMILIES[mt].attention_sinks:
        return "attention sinks"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


def _rms_norm(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)`` for an HF RMSNorm; in fp32 the fused ``F.rms_norm`` (same formula, one kernel
    instead of seven small ops). Other dtypes keep HF's own rounding order."""
    eps = getattr(mod, "variance_epsilon", None)
    if x.dtype != torch.float32 or eps is None:
        return mod(x)
    return F.rms_norm(x, (x.shape[-1],), mod.weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary embedding of ``x [.., hd]``; with partial RoPE (GLM-4.5's ``partial_rotary_factor``)
    ``cos``/``sin`` cover the first channels only and the rest pass through unrotated."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    head = x[..., :rot]
    return torch.cat((head * cos + _rotate_half(head) * sin, x[..., rot:]), dim=-1)


class LlamaFamilyDecoder:
    """Decode step over a llama-family ``*ForCausalLM`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5) take [batch, seq, hidden]; their routers see [B, H] tokens
        # either way, so the routed-experts capture (mrl/rollout/engine/moe.py) works on this path too.
        self.moe = [hasattr(layer.mlp, "experts") for layer in model.model.layers]

    @torch.inference_mode()
    def __call__(self, rb: RunningBatch) -> torch.Tensor:
        """Feeds ``rb.last_tokens`` at ``rb.next_pos``; writes their K/V, returns logits ``[B, V]``."""
        base = self.model.model
        B, nh, nkv, hd = rb.size, self.n_heads, self.n_kv, self.head_dim
        g = nh // nkv
        col = rb.reserve_column()
        rb.bias[:B, col] = 0.0  # the new token attends to itself
        bias = rb.attn_bias(col + 1)[:, None, None, :]  # [B, 1, 1, L]
        h = base.embed_tokens(rb.last_tokens)  # [B, H]
        cos, sin = base.rotary_emb(h[:, None, :], rb.next_pos[:, None])  # [B, 1, hd]
        cos, sin = cos[:, None, 0, :], sin[:, None, 0, :]  # [B, 1, hd] broadcast over heads
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = _rms_norm(layer.input_layernorm, h)
            q = attn.q_proj(x).view(B, nh, hd)
            k = attn.k_proj(x).view(B, nkv, hd)
            v = attn.v_proj(x).view(B, nkv, hd)
            if hasattr(attn, "q_norm"):  # qwen3, GLM-4.5 (use_qk_norm): RMSNorm over each head
                q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            rb.k[i][:B, :, col] = k
            rb.v[i][:B, :, col] = v
            # GQA without repeating K/V: the g query heads of one KV head are that head's g
            # "query positions" (decode has no causal mask among them): [B, nkv, g, hd].
            o = F.scaled_dot_product_attention(
                q.view(B, nkv, g, hd), rb.keys(i, col + 1), rb.values(i, col + 1), attn_mask=bias,
                scale=attn.scaling,
            ).reshape(B, nh * hd)
            h = h + attn.o_proj(o)
            x = _rms_norm(layer.post_attention_layernorm, h)
            h = h + (layer.mlp(x[:, None, :])[:, 0] if self.moe[i] else layer.mlp(x))
        h = _rms_norm(base.norm, h)
        rb.commit_column()
        return lm_head_chunked(self.model.lm_head, h)


def lm_head_chunked(head: torch.nn.Linear, h: torch.Tensor, chunk: int = LM_HEAD_CHUNK) -> torch.Tensor:
    """``head(h)`` computed in vocabulary slices of ``chunk`` rows (same values, faster on CPU)."""
    w, b = head.weight, head.bias
    if h.device.type != "cpu" or w.shape[0] <= chunk:
        return F.linear(h, w, b)
    return torch.cat([F.linear(h, w[s: s + chunk], None if b is None else b[s: s + chunk])
                      for s in range(0, w.shape[0], chunk)], dim=1)


@torch.inference_mode()
def hf_decode(model: torch.nn.Module, rb: RunningBatch) -> torch.Tensor:
    """Generic decode step through the model's own forward (any causal LM)."""
    col = rb.reserve_column()
    cache = DynamicCache(config=model.config)
    for i in range(len(rb.k)):
        cache.update(rb.keys(i), rb.values(i), i)
    mask = torch.cat([rb.valid_mask(), torch.ones(rb.size, 1, dtype=torch.long, device=rb.device)], dim=1)
    out = model(input_ids=rb.last_tokens[:, None], attention_mask=mask, position_ids=rb.next_pos[:, None],
                past_key_values=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        rb.k[i][: rb.size, :, col] = layer.keys[:, :, -1]
        rb.v[i][: rb.size, :, col] = layer.values[:, :, -1]
    rb.bias[: rb.size, col] = 0.0
    rb.commit_column()
    return out.logits[:, -1, :]
