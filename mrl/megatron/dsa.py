"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5) on Megatron's multi-latent attention, on CPU and GPU.

Each attention layer has a *lightning indexer* that picks, per query, the ``index_topk`` earlier tokens the MLA
softmax may attend; every other key is masked. With ``x`` the attention input (after the layer's input norm) and
``c_q = rmsnorm(q_a_proj x)`` MLA's query latent (Megatron's ``q_compressed``), per query ``s`` and key ``t``::

    q_{s,h} = rope(wq_b c_q)_{s,h}          [H heads, D dims]     rope on the FIRST r = qk_rope_head_dim dims
    k_t     = rope(layernorm(wk x_t))       [D]                   (one key head, LayerNorm with bias, eps 1e-6)
    w_{s,h} = (weights_proj x_s)_h · H^-1/2
    I_{s,t} = sum_h w_{s,h} · relu(q_{s,h} · k_t · D^-1/2)        for t <= s (t > s: -inf)
    keep_s  = topk_t(I_{s,.}, min(index_topk, keys))              then causal again
    O_s     = softmax_{t in keep_s}(scale · Q_s K_t) V_t          (MLA's heads, scale and values unchanged)

The indexer's RoPE uses the model's rotary table (YaRN's attention factor included, as transformers' shared
``position_embeddings``): DeepSeek-V3.2 rotates the half-split layout, GLM-5 the interleaved pair layout
(``rope_interleaved``; Megatron's de-interleave-then-rotate-halves, the same dot products). This is
transformers 5.25's ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` (bf16 there; the Hadamard rotation of
DeepSeek's kernel is orthogonal and dropped, as transformers does). Selection ties are broken as
``torch.topk`` does.

Why not megatron-core 0.16.1's ``experimental_attention_variant/dsa.py``: its ``rotate_activation`` asserts
bf16 and the ``fast_hadamard_transform`` CUDA package, it rotates the *last* ``r`` indexer dims (transformers and
the released checkpoints: the first), refuses packed rows and allocates its loss tracker with
``torch.cuda.current_device()``. mrl uses Megatron's MLA with ``experimental_attention_variant="dsa"`` (which
hands ``x`` and ``c_q`` to the core attention) and this module as the core attention.

RL: the indexer is frozen (``requires_grad=False``: absent from DDP buckets and the optimizer) and computed without
autograd on detached inputs, as transformers (``@torch.no_grad``) — the top-k is not differentiable anyway. Its
own training signal upstream (DeepSeek-V3.2's KL "indexer warm-up" against the dense attention) is not built.

Cost: the scores are computed per block of query rows (``SCORE_BUDGET``), the top-k per row inside its block; what
stays is the ``[b, s, s]`` boolean mask (one byte per query-key pair) that SDPA then applies (its masked kernel,
not the flash one): memory and time quadratic in the row, unlike DeepSeek's sparse kernels (not built here).

Packed rows (``PackedSeqParams``): each sequence selects among its own keys only (one indexer + SDPA call per
sequence). Tensor parallelism: the indexer is replicated on every TP rank (its inputs are full there: ``c_q`` is
gathered by MLA), so every rank picks the same keys for its heads. Context parallelism and sequence parallelism
are refused (Megatron's config asserts the former; MLA on mrl's local spec builds no sequence-parallel norms).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType

from mrl.megatron.sdpa_attention import SDPAAttention

Tensor = torch.Tensor
SCORE_BUDGET = 1 << 25  # float32 entries of one query block's [b, rows, H, keys] head scores (128 MiB)


class LightningIndexer(torch.nn.Module):
    """The indexer's weights (HF ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``) and its top-k choice."""

    def __init__(self, config: Any, rope_interleaved: bool) -> None:
        super().__init__()
        self.heads, self.dim = int(config.dsa_indexer_n_heads), int(config.dsa_indexer_head_dim)
        self.topk, self.rope_dim = int(config.dsa_indexer_topk), int(config.qk_pos_emb_head_dim)
        self.rope_interleaved = rope_interleaved
        kw = {"dtype": config.params_dtype,
              "device": "cpu" if config.use_cpu_initialization or not torch.cuda.is_available()
              else torch.cuda.current_device()}
        self.linear_wq_b = torch.nn.Linear(int(config.q_lora_rank), self.heads * self.dim, bias=False, **kw)
        self.linear_wk = torch.nn.Linear(config.hidden_size, self.dim, bias=False, **kw)
        self.k_norm = torch.nn.LayerNorm(self.dim, eps=1e-6, **kw)
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, self.heads, bias=False, **kw)
        for p in self.parameters():  # frozen in RL (module docstring)
            p.requires_grad_(False)

    def _rope(self, t: Tensor, freqs: Tensor, mscale: float) -> Tensor:
        from megatron.core.models.common.embeddings.rope_utils import (
            _apply_rotary_pos_emb_bshd,
        )

        # Megatron's unfused rotation of the first freqs.shape[-1] dims; multi_latent_attention=True
        # de-interleaves (even, odd) first: the interleaved pair layout
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False,
                                          multi_latent_attention=self.rope_interleaved, mscale=mscale)

    @torch.no_grad()
    def keep(self, x: Tensor, qr: Tensor, freqs: Tensor, mscale: float) -> Tensor:
        """``x [s, b, hidden]``, ``qr [s, b, q_lora_rank]``, ``freqs [s, 1, 1, r]`` (angles of positions 0..s-1) ->
        ``[b, s, s]`` bool, True where query s attends key t (its top-k among t <= s)."""
        s, b = x.shape[:2]
        f32 = torch.float32
        q = self._rope(self.linear_wq_b(qr).view(s, b, self.heads, self.dim), freqs, mscale).to(f32)
        k = self._rope(self.k_norm(self.linear_wk(x)).view(s, b, 1, self.dim), freqs, mscale)[:, :, 0].to(f32)
        w = self.linear_weights_proj(x).to(f32) * self.heads ** -0.5  # [s, b, H]
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        k_bt = k.permute(1, 2, 0)  # [b, D, s]
        keep = torch.zeros(b, s, s, dtype=torch.bool, device=x.device)
        rows = max(1, SCORE_BUDGET // max(1, b * self.heads * s))
        for lo in range(0, s, rows):  # query blocks: all rows' per-head scores at once would be s^2 H floats
            qb = q[lo: lo + rows].permute(1, 0, 2, 3)  # [b, n, H, D]
            scores = torch.relu(torch.matmul(qb, k_bt[:, None]) * self.dim ** -0.5)  # [b, n, H, s]
            index = torch.matmul(w[lo: lo + rows].permute(1, 0, 2)[:, :, None], scores)[:, :, 0]  # [b, n, s]
            index = index.masked_fill(~causal[lo: lo + rows], float("-inf"))
            keep[:, lo: lo + rows].scatter_(-1, index.topk(min(self.topk, s), dim=-1).indices, True)
        return keep & causal


class DSAAttention(SDPAAttention):
    """Core attention of an MLA layer with DeepSeek sparse attention: :class:`SDPAAttention` under the indexer's
    top-k mask (module docstring). ``rope_interleaved`` comes from the family (its layer-spec params)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 rope_interleaved: bool = False, **kwargs: Any) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        if self._cp_group is not None:
            raise ValueError("DeepSeek sparse attention with context_parallel_size > 1 is not supported; "
                             "fix: megatron.context_parallel_size=1")
        if config.q_lora_rank is None:
            raise ValueError("DeepSeek sparse attention needs q_lora_rank (the indexer reads MLA's query latent)")
        self.indexer = LightningIndexer(config, rope_interleaved)
        self.rotary_pos_emb = _rotary(config)
        pg = kwargs.get("pg_collection")
        self._indexer_tp_group = pg.tp if pg is not None and hasattr(pg, "tp") else None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The indexer's tensors, replicated over TP (the parent's covers sinks, which MLA models have none of)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.utils import sharded_state_dict_default

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        # the TP group named: without it the default gives every TP rank replica id 0 (two "main" copies)
        tp = self._indexer_tp_group or ps.get_tensor_model_parallel_group()
        out.update(sharded_state_dict_default(self.indexer, f"{prefix}indexer.", sharded_offsets, metadata, tp))
        return out

    def _freqs(self, n: int) -> tuple[Tensor, float]:
        """RoPE angles of positions 0..n-1 ``[n, 1, 1, r]`` and YaRN's attention factor (1 for plain RoPE)."""
        table = self.rotary_pos_emb(n, packed_seq=True)  # packed_seq: never cut into a CP share (CP refused)
        return table if isinstance(table, tuple) else (table, 1.0)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, qr: Tensor) -> Tensor:
        """``[s, b, h, d]`` q/k/v of whole causal rows (one sequence per row from position 0) -> ``[s, b, h, dv]``."""
        keep = self.indexer.keep(x, qr, *self._freqs(q.shape[0]))  # [b, s, s]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return self._sdpa(q, k, v, keep[:, None], False).permute(2, 0, 1, 3)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None, x: Tensor | None = None, qr: Tensor | None = None) -> Tensor:
        """As :meth:`SDPAAttention.forward`, plus ``x`` (the attention input) and ``qr`` (MLA's query latent), which
        Megatron's MLA passes when ``experimental_attention_variant == "dsa"``."""
        if x is None or qr is None:
            raise ValueError("DSAAttention needs x and qr: build MLA with experimental_attention_variant='dsa'")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if attention_bias is not None or attention_mask is not None or mask_type != AttnMaskType.causal:
            raise ValueError("DeepSeek sparse attention runs causal rows without an explicit attention mask; the "
                             "shared-prefix layout (actor.shared_prefix) is not supported with it")
        if self.config.sequence_parallel:  # x would be this rank's share of the row (MLA's local spec has no SP)
            raise ValueError("DeepSeek sparse attention with sequence_parallel=true is not supported; "
                             "fix: megatron.sequence_parallel=false")
        thd = query.dim() == 3  # MLA hands qkv_format="thd" rows over as [T, heads, d]
        if thd:
            query, key, value = query[:, None], key[:, None], value[:, None]
        s, b = query.shape[:2]
        x, qr = x.detach().reshape(s, b, -1), qr.detach().reshape(s, b, -1)  # packed: MLA squeezed qr to [T, r]
        if packed_seq_params is None:
            out = self._attend(query, key, value, x, qr)
        else:
            if b != 1:
                raise ValueError(f"DeepSeek sparse attention: packed rows come one per micro-batch, got {b}")
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            out = torch.cat([self._attend(*(t[lo:hi] for t in (query, key, value, x, qr)))
                             for lo, hi in itertools.pairwise(bounds)], 0)  # each sequence selects in itself
        out = out.reshape(s, b, -1)
        return out[:, 0] if thd else out


def _rotary(config: Any) -> torch.nn.Module:
    """The MLA layer's rotary table, built as Megatron's ``MLASelfAttention`` builds its own (plain or YaRN)."""
    from megatron.core.models.common.embeddings import (
        RotaryEmbedding,
        YarnRotaryEmbedding,
    )

    if config.rope_type == "rope":
        return RotaryEmbedding(config.qk_pos_emb_head_dim, rotary_percent=config.rotary_percent,
                               rotary_base=config.rotary_base)
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(config.qk_pos_emb_head_dim, rotary_base=config.rotary_base,
                                   scaling_factor=config.rotary_scaling_factor,
                                   original_max_position_embeddings=config.original_max_position_embeddings,
                                   beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                                   mscale_all_dim=config.mscale_all_dim)
    raise ValueError(f"DeepSeek sparse attention: rope_type {config.rope_type!r} is not 'rope' or 'yarn'")


__all__ = ["DSAAttention", "LightningIndexer"]
