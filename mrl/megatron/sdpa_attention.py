"""Megatron core attention over ``torch.nn.functional.scaled_dot_product_attention`` (``attention_backend: sdpa``).

Megatron-Core's local ``DotProductAttention`` (the only core attention without Transformer Engine)
materialises every head's ``[s, s]`` score matrix (baddbmm, masked_fill, softmax, bmm): memory and time
quadratic in the sequence, and the largest kernels after the GEMMs on a GPU. This module computes the same
function through SDPA, which picks a fused kernel (CUDA: flash / memory-efficient / cuDNN; CPU: the flash
kernel), so no score matrix is kept::

    O_h = softmax(scale · Q_h K_{g(h)}^T + M) V_{g(h)},   g(h) = h // (heads / groups)   (GQA)

with ``scale`` the model's softmax scale (default ``1/sqrt(d_k)``), ``M`` the causal mask, or a sliding
window (Megatron's ``window_size = (left, right)``: key ``k`` is seen by query ``q`` iff
``q - left <= k <= q + right``), or the boolean ``attention_mask`` the caller passes (Megatron's convention,
True = masked; the shared-prefix layout's block mask). Query/key head dim ``d_k`` and value head dim
``d_v`` may differ (``k_channels``/``v_channels``: multi-latent attention).

Packed rows (``use_remove_padding``, :func:`mrl.workers.minibatch.build_packed_inputs`): the caller passes
``PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=...)`` for a ``[T, 1, heads, d]`` row of whole sequences;
attention never crosses ``cu_seqlens`` boundaries. On CUDA that is one ``varlen_attn`` call (flash attention
over variable lengths) when torch has it; elsewhere one causal SDPA call per sequence (each uses the flash
kernel: memory linear in the row). Megatron itself reads ``qkv_format="sbhd"`` as "not THD", so it keeps the
``[s, b]`` layout and leaves RoPE to :mod:`mrl.megatron.rope_positions` (positions restart per sequence).

Attention sinks (gpt-oss; Megatron ``softmax_type="learnable"``, or ``"off-by-one"``: a sink fixed at 0): each head
``h`` has a sink logit ``s_h`` that joins every query's softmax denominator and carries no value::

    O_h = sum_k exp(z_k) V_k / (sum_k exp(z_k) + exp(s_h)),   z = scale · Q_h K^T + M

(transformers' ``GptOssAttention``: the sink column is appended to the scores and dropped after the softmax).
SDPA has no sink input, so the sink enters as one extra key that every query sees: the query gets one more
component ``s_h / scale`` and the keys one more, 0 for the real keys and 1 for the sink key, whose value is
zero; its score is exactly ``s_h``, so SDPA's softmax is the one above, with gradients for ``s_h`` through
autograd. The sink key needs an explicit boolean mask (``[sq, sk + 1]``: the causal/window mask plus an
always-attended column), and packed rows on CUDA run per sequence (``varlen_attn`` has no sink). The
sink is ``core_attention.softmax_offset`` as in Megatron's ``DotProductAttention``: one logit per local head,
split over TP along the heads. On CPU (no dropout, no right window) causal attention with sinks or left windows
needs no mask at all: :mod:`mrl.megatron.blockwise_attention` (maskless flash calls merged by log-sum-exp).

Context parallelism (:mod:`mrl.megatron.context_parallel`): a packed row's zigzag share; K/V all-gathered over the
CP group, each local query chunk attending its sequence's key prefix (:meth:`SDPAAttention._packed_cp`).

Interface: megatron-core 0.16's core attention ``forward(query, key, value, attention_mask, attn_mask_type,
attention_bias, packed_seq_params)`` on ``[s, b, heads, dim]`` tensors, returning ``[s, b, heads · d_v]``.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

Tensor = torch.Tensor


@functools.cache
def _varlen_attn() -> tuple[Any, bool] | None:
    """(torch's packed variable-length flash attention (CUDA), whether it takes ``enable_gqa``), or None where this
    torch lacks it. ``enable_gqa`` came after the function itself (torch 2.12 lists it, 2.11 may not)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


class SDPAAttention(MegatronModule):
    """Drop-in for Megatron's ``DotProductAttention`` in the local layer spec's ``core_attention`` slot."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None, **_unused: Any) -> None:
        super().__init__(config=config)
        self._cp_group: Any = None
        if config.context_parallel_size > 1:  # K/V all-gathered over CP (mrl.megatron.context_parallel)
            self._cp_group = pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else None
            if self._cp_group is None:
                from megatron.core import parallel_state as ps

                self._cp_group = ps.get_context_parallel_group()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides by layer_number and multiplies back inside its fp32
        # softmax: the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        window = config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None
        self.window: tuple[int, int] | None = tuple(window) if window else None  # (left, right)
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        self._tp_group: Any = None
        self.softmax_offset: Tensor | None = self._make_sinks(config, pg_collection)

    def _make_sinks(self, config: Any, pg_collection: Any) -> Tensor | None:
        """Megatron's ``softmax_offset``: None (vanilla), zeros (off-by-one) or a learnable logit per local head."""
        if self.softmax_type == "vanilla":
            return None
        if self.softmax_type not in ("off-by-one", "learnable"):
            raise ValueError(f"attention_backend=sdpa: softmax_type={self.softmax_type!r} is not one of "
                             "'vanilla', 'off-by-one', 'learnable'")
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import (
            set_tensor_model_parallel_attributes,
        )

        if pg_collection is not None and hasattr(pg_collection, "tp"):
            self._tp_group = pg_collection.tp
        elif ps.model_parallel_is_initialized():
            self._tp_group = ps.get_tensor_model_parallel_group()
        tp = self._tp_group.size() if self._tp_group is not None else 1
        heads = config.num_attention_heads // tp
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        sinks = torch.zeros(heads, dtype=config.params_dtype, device=device)
        if self.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", sinks, persistent=False)
            return self.softmax_offset
        param = torch.nn.Parameter(sinks)
        if config.perform_initialization:
            config.init_method(param.data)
        # split over TP along the heads: the grad-norm and the checkpoint treat it as a TP shard, not a duplicate
        set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
        self.register_parameter("softmax_offset", param)
        return param

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """As Megatron's ``DotProductAttention``: the learnable sink is a TP shard along the heads (axis 0), so a
        checkpoint saved at one TP loads at another (the default would save it as a replicated tensor)."""
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
        )

        if self.softmax_type != "learnable":
            return {}  # no parameters (an off-by-one sink is a fixed buffer)
        state = self.state_dict(prefix="", keep_vars=True)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    # ---- masks -------------------------------------------------------------------------------
    def _window_mask(self, sq: int, sk: int, device: torch.device, window: tuple[int, int] | None = None) -> Tensor:
        """[sq, sk] bool, True = attended: ``q - left <= k <= q + right`` (keys aligned to the queries' end);
        ``window``: this layer's (default) or e.g. ``(-1, 0)``, the causal mask of queries at the keys' end."""
        left, right = window or self.window  # type: ignore[misc]
        q = torch.arange(sq, device=device)[:, None] + (sk - sq)
        k = torch.arange(sk, device=device)[None, :]
        keep = k <= q + right
        if left >= 0:
            keep &= k >= q - left
        return keep

    def _maskless(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether causal attention of these queries (the keys' last) runs blockwise without a mask
        (:mod:`mrl.megatron.blockwise_attention`): CPU, one head size, no dropout, no right window."""
        from mrl.megatron import blockwise_attention as bw

        return (bw.usable(q, k.shape[-1], v.shape[-1]) and not (self.training and self.dropout_p)
                and (self.window is None or self.window[1] == 0))

    def _blockwise(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention (with this layer's left window and sinks) of queries at the keys' end, no mask."""
        from mrl.megatron.blockwise_attention import blockwise_attention

        left = self.window[0] if self.window is not None and self.window[0] >= 0 else None
        sink = None if self.softmax_offset is None else self.softmax_offset.to(q.dtype)
        (b, h, s, _), g = q.shape, k.shape[1]
        rep = h // g  # GQA: query head i reads KV head i // rep
        if rep == 1:
            return blockwise_attention(q, k, v, self.softmax_scale, window=left, sink=sink)
        # The kernel takes one head count: one call per r < rep on query heads {j·rep + r} against the g KV heads
        # as they are. Expanding K/V to h heads instead would keep rep copies of every key prefix for the
        # backward (under CP each rank's prefixes add up to (2·CP + 1)/(2·CP) of the whole row).
        qg = q.view(b, g, rep, s, q.shape[-1])
        sg = None if sink is None else sink.view(g, rep)
        outs = [blockwise_attention(qg[:, :, r], k, v, self.softmax_scale, window=left,
                                    sink=None if sg is None else sg[:, r]) for r in range(rep)]
        return torch.stack(outs, 2).view(b, h, s, v.shape[-1])

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        """[b, h, s, d] SDPA with GQA and this layer's scale/dropout (mask: True = attended). Causal attention with
        windows or sinks runs blockwise without a mask where it can (:meth:`_maskless`)."""
        if (mask is None and causal and q.shape[-2] == k.shape[-2]
                and (self.window is not None or self.softmax_offset is not None) and self._maskless(q, k, v)):
            return self._blockwise(q, k, v)
        if mask is None and self.window is not None:
            mask = self._window_mask(q.shape[-2], k.shape[-2], q.device)
            causal = False
        if self.softmax_offset is not None:
            q, k, v, mask = self._with_sink_key(q, k, v, mask, causal)
            causal = False
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None,
            dropout_p=self.dropout_p if self.training else 0.0, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1])

    def _with_sink_key(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k, v and the mask with the sink key appended (see the module docstring): query component
        ``s_h / scale``, key component 1 on the sink key and 0 on the others, zero value; q/k padded with zeros to a
        multiple of 8 components (the fused CUDA kernels' alignment), which changes no dot product."""
        (b, h, sq, d), (g, sk) = q.shape, k.shape[1:3]
        if mask is None:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
            if causal:  # queries aligned to the keys' end, as SDPA's is_causal with sq == sk
                mask = mask.tril(sk - sq)
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
        width = -(-(d + 1) // 8) * 8
        sink = (self.softmax_offset.to(q.dtype) / self.softmax_scale).view(1, h, 1, 1).expand(b, h, sq, 1)
        q = torch.cat([q, sink, q.new_zeros(b, h, sq, width - d - 1)], dim=-1)
        sink_key = k.new_zeros(b, g, 1, width)
        sink_key[..., d] = 1.0
        k = torch.cat([F.pad(k, (0, width - d)), sink_key], dim=-2)
        v = torch.cat([v, v.new_zeros(b, g, 1, v.shape[-1])], dim=-2)
        return q, k, v, mask

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: Any = None) -> Tensor:
        """``[sq, b, np, dk]``, ``[sk, b, ng, dk]``, ``[sk, b, ng, dv]`` -> ``[sq, b, np · dv]``."""
        if attention_bias is not None:
            raise ValueError("attention_backend=sdpa: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # multi-latent attention hands packed rows over as [T, heads, d] (no batch dim) and takes [T, heads · dv]
            out = self._packed(query[:, None], key[:, None], value[:, None], packed_seq_params, causal)
            return out.reshape(query.shape[0], query.shape[1] * value.shape[-1])
        sq, b, heads = query.shape[:3]
        if packed_seq_params is not None:
            out = self._packed(query, key, value, packed_seq_params, causal)
        else:
            if self._cp_group is not None:
                raise ValueError("attention_backend=sdpa: context parallelism runs on packed rows only "
                                 "(actor.use_remove_padding); this micro-batch is not packed")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
            mask = None if attention_mask is None else ~attention_mask.to(torch.bool)
            if causal and mask is None and sq != key.shape[0]:
                raise ValueError(f"attention_backend=sdpa: causal attention with {sq} queries and "
                                 f"{key.shape[0]} keys (no KV cache in training)")
            out = self._sdpa(q, k, v, mask, causal and sq > 1).permute(2, 0, 1, 3)  # [sq, b, h, dv]
        return out.reshape(sq, b, heads * value.shape[-1])

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: Any, causal: bool) -> Tensor:
        """One ``[T, 1, h, d]`` row of whole sequences (``params.cu_seqlens_q``) -> ``[T, 1, h, dv]``."""
        if params.qkv_format not in ("sbhd", "thd") or query.shape[1] != 1:
            raise ValueError(f"attention_backend=sdpa: packed rows come as qkv_format='sbhd' with one row (or 'thd'), got "
                             f"{params.qkv_format!r} and {query.shape[1]} rows")
        if not causal:
            raise ValueError("attention_backend=sdpa: packed rows are causal language-model rows")
        cu = params.cu_seqlens_q
        q, k, v = query[:, 0], key[:, 0], value[:, 0]  # [T, h, d]
        if self._cp_group is not None:
            return self._packed_cp(q, k, v, cu.cpu())[:, None]
        fused = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not (self.training and self.dropout_p)
        varlen = _varlen_attn() if fused and self.softmax_offset is None else None
        if varlen is not None:
            fn, takes_gqa = varlen
            left, right = self.window if self.window is not None else (-1, 0)
            cu32 = cu.to(q.device, torch.int32)
            kw: dict[str, Any] = {"scale": self.softmax_scale, "window_size": (left, right)}
            if q.shape[1] != k.shape[1]:
                if takes_gqa:
                    kw["enable_gqa"] = True
                else:  # each KV head repeated for its query heads (what GQA computes, in more memory)
                    rep = q.shape[1] // k.shape[1]
                    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            # the flash kernel takes one head size, a multiple of 8: q/k/v zero-padded to it (no dot product or
            # weighted sum changes; the scale is passed explicitly), the output cut back to dv. MLA's d_k != d_v
            # (DeepSeek-V3: 192 / 128) and odd test sizes need it.
            dk, dv = q.shape[-1], v.shape[-1]
            width = -(-max(dk, dv) // 8) * 8
            if dk != width:
                q, k = F.pad(q, (0, width - dk)), F.pad(k, (0, width - dk))
            if dv != width:
                v = F.pad(v, (0, width - dv))
            out = fn(q, k, v, cu32, cu32, int(params.max_seqlen_q), int(params.max_seqlen_kv), **kw)
            return out[..., :dv][:, None]
        bounds = cu.tolist()
        outs = []
        for s, e in itertools.pairwise(bounds):  # each sequence alone: causal within it, nothing across
            seg = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))  # [1, h, len, d]
            outs.append(self._sdpa(*seg, None, e - s > 1)[0].transpose(0, 1))
        return torch.cat(outs, 0)[:, None]

    def _packed_cp(self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor) -> Tensor:
        """This CP rank's zigzag row (:mod:`mrl.megatron.context_parallel`) ``[T/CP, h, d]`` -> ``[T/CP, h, dv]``.

        ``cu`` bounds the whole row's (padded) sequences. K and V of every rank are gathered (one collective for
        both), put back in global order, and each local query chunk ``j`` of a sequence (``c`` columns at global
        offset ``j·c``) attends that sequence's keys ``[0, (j + 1)·c)`` under the causal (or window) mask aligned
        to the keys' end; sinks join every query's softmax as without CP."""
        from mrl.megatron.context_parallel import gather_kv, global_order, zigzag_chunks

        group = self._cp_group
        cp, rank = group.size(), group.rank()
        dk = k.shape[-1]
        kv = gather_kv(torch.cat([k, v], -1), group)  # [cp, T/cp, g, dk + dv]
        full = kv.flatten(0, 1)[global_order(cu, cp).to(kv.device)]  # [T, g, dk + dv], global column order
        outs, lo = [], 0
        window = self.window if self.window is not None else (-1, 0)
        for start, n in zip(cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()):
            c = n // (2 * cp)
            for a, j in enumerate(zigzag_chunks(cp, rank)):
                qs = q[lo + a * c: lo + (a + 1) * c].transpose(0, 1)[None]  # [1, h, c, d]
                keys = full[start: start + (j + 1) * c].transpose(0, 1)[None]  # [1, g, (j + 1)c, dk + dv]
                outs.append(self._chunk(qs, keys[..., :dk], keys[..., dk:], window)[0].transpose(0, 1))
            lo += 2 * c
        return torch.cat(outs, 0)

    def _chunk(self, q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int]) -> Tensor:
        """``[1, h, c, d]`` queries at the last ``c`` of ``[1, g, (j + 1)c, d]`` keys, causal (or ``window``) aligned
        to the keys' end, sinks included. On CPU without dropout: blockwise, no mask
        (:mod:`mrl.megatron.blockwise_attention`: memory linear in the keys); elsewhere through an explicit
        ``[c, (j + 1)c]`` mask."""
        if self._maskless(q, k, v):
            return self._blockwise(q, k, v)
        return self._sdpa(q, k, v, self._window_mask(q.shape[-2], k.shape[-2], q.device, window), False)
