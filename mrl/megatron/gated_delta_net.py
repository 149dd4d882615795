"""Gated DeltaNet as a Megatron ``self_attention`` module (Qwen3.5 / Qwen3.6 / Qwen3-Next linear-attention layers).

megatron-core 0.16.1 has a ``GatedDeltaNet``, but it needs the ``fla`` package (CUDA/Triton) to be built at all,
refuses packed rows (``NotImplementedError``) and fuses its input projection in its own order. This module
computes the same layer as transformers' ``Qwen3_5GatedDeltaNet``, on any device, for compact rows
(``[s, b, h]``) and packed rows (``[T, 1, h]`` + ``cu_seqlens``: state and conv window restart per sequence)::

    [q k v | z | b | a] = in_proj(x)                       one column-parallel GEMM, each part split over TP
    [q k v] = silu(causal_depthwise_conv1d([q k v]))        kernel K, per channel, zero history per sequence
    q, k    = l2norm(q), l2norm(k)  per head; repeated to the value heads (head h reads key head h // (n_v/n_k))
    g       = −exp(A_log) · softplus(a + dt_bias),  β = sigmoid(b)                 per value head
    o       = gated_delta_rule(q, k, v, g, β)          (:mod:`mrl.megatron.delta_rule`)
    y       = out_proj(rmsnorm(o) · w · silu(z))      per value head; out_proj row-parallel

Tensor parallelism splits the key heads and the value heads over TP (both counts divisible by TP); every
per-head or per-channel tensor follows its heads (the conv1d channels ``[q | k | v]``, ``A_log``, ``dt_bias``),
the gated norm's ``w`` (one value head wide) is replicated. The HF ↔ Megatron layout of ``in_proj`` and
``conv1d`` is the ``sections`` split of :mod:`mrl.megatron.mapping`. Sequence parallelism and context
parallelism are refused by the plan (the recurrence runs over the whole sequence on one rank).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from mrl.megatron.delta_rule import (
    _fla_kernel,
    fla_available,
    gated_delta_rule,
    l2_normalize,
    sequence_index,
)

Tensor = torch.Tensor


def gdn_sizes(config: Any) -> dict[str, int]:
    """Widths of one GDN layer from Megatron's ``linear_*`` config fields (whole model, not per rank)."""
    nk, nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    return {"nk": nk, "nv": nv, "dk": dk, "dv": dv, "key_dim": nk * dk, "value_dim": nv * dv,
            "conv_dim": 2 * nk * dk + nv * dv, "kernel": int(config.linear_conv_kernel_dim)}


class GatedRMSNorm(torch.nn.Module):
    """``rmsnorm(x) · w · silu(z)`` over the last dim (transformers' ``RMSNormGated``: normalised in fp32, scaled by
    ``w`` in the input dtype, gated in fp32). ``w`` is shared by every value head, and TP splits the heads: each rank's
    gradient of ``w`` covers its own heads only, so the weight enters through Megatron's
    ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward) and every rank gets the sum."""

    def __init__(self, width: int, eps: float, dtype: torch.dtype, device: Any, tp_size: int = 1) -> None:
        super().__init__()
        self.eps = eps
        self.tp_size = tp_size
        self.weight = torch.nn.Parameter(torch.ones(width, dtype=dtype, device=device))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        dtype = x.dtype
        w = copy_to_tensor_model_parallel_region(self.weight) if self.tp_size > 1 else self.weight
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = w * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class GatedDeltaNet(MegatronModule):
    """The token mixer of a linear-attention layer (module docstring); built by Megatron's ``TransformerLayer`` in
    place of ``SelfAttention``, called with the same arguments, returning ``(output, bias=None)``."""

    def __init__(self, config: Any, submodules: Any = None, layer_number: int | None = None,
                 pg_collection: Any = None, **_unused: Any) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        super().__init__(config)
        self.layer_number = layer_number
        tp = pg_collection.tp if pg_collection is not None else ps.get_tensor_model_parallel_group()
        self.tp_size = tp.size()
        s = gdn_sizes(config)
        if s["nk"] % self.tp_size or s["nv"] % self.tp_size or s["nv"] % s["nk"]:
            raise ValueError(f"Gated DeltaNet with {s['nk']} key heads and {s['nv']} value heads at TP={self.tp_size}: "
                             "both head counts must be divisible by TP, and the value heads by the key heads")
        self.sizes = s
        t = self.tp_size
        self.local = {"key_dim": s["key_dim"] // t, "value_dim": s["value_dim"] // t, "nv": s["nv"] // t,
                      "nk": s["nk"] // t}
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, s["conv_dim"] + s["value_dim"] + 2 * s["nv"], config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=True, tp_group=tp)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        conv_local = s["conv_dim"] // t
        # a depthwise conv weight as nn.Conv1d stores it: [channels, 1, K]
        self.conv1d_weight = torch.nn.Parameter(torch.empty(conv_local, 1, s["kernel"], dtype=config.params_dtype,
                                                            device=device))
        self.A_log = torch.nn.Parameter(torch.empty(s["nv"] // t, dtype=config.params_dtype, device=device))
        self.dt_bias = torch.nn.Parameter(torch.ones(s["nv"] // t, dtype=config.params_dtype, device=device))
        for p in (self.conv1d_weight, self.A_log, self.dt_bias):
            tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
        with torch.no_grad():
            torch.nn.init.uniform_(self.conv1d_weight, -0.5, 0.5)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        self.norm = GatedRMSNorm(s["dv"], config.layernorm_epsilon, config.params_dtype, device, self.tp_size)
        self.out_proj = tensor_parallel.RowParallelLinear(
            s["value_dim"], config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, tp_group=tp)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *, packed_seq_params: Any = None,
                inference_context: Any = None, **_unused: Any) -> tuple[Tensor, None]:
        if inference_context is not None:
            raise NotImplementedError("Gated DeltaNet layers are not run for Megatron inference in mrl "
                                      "(the rollout engine serves them)")
        if attention_mask is not None:
            # the shared-prefix layout's block mask: a recurrence cannot branch several samples off one prompt
            raise ValueError("Gated DeltaNet layers cannot take a block attention mask (shared-prefix rows); "
                             "use packed or compact rows")
        s_len, b, _ = hidden_states.shape
        x, _ = self.in_proj(hidden_states)  # [s, b, local width]
        loc = self.local
        qkv, z, beta_in, a = torch.split(
            x, [2 * loc["key_dim"] + loc["value_dim"], loc["value_dim"], loc["nv"], loc["nv"]], dim=-1)
        cu = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
        o = self._mix(qkv, beta_in, a, cu)  # [s, b, nv_local, dv]
        z = z.reshape(s_len, b, loc["nv"], self.sizes["dv"])
        y = self.norm(o, z).reshape(s_len, b, loc["value_dim"])
        out, _ = self.out_proj(y)
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None,
                           tp_group: Any = None) -> dict:
        """Megatron distributed-checkpoint view: the per-head tensors split over TP along dim 0, and ``in_proj`` /
        ``conv1d_weight`` as their named row blocks (``query``, ``key``, ``value``, ``z``, ``beta``, ``alpha``), each
        split over TP on its own, so a checkpoint saved at one TP loads at another (a rank's shard interleaves the
        blocks: one contiguous split would mix q, k and v across ranks)."""
        from megatron.core import parallel_state as ps
        from megatron.core.ssm.gated_delta_net import _split_tensor_factory
        from megatron.core.transformer.utils import (
            ensure_metadata_has_dp_cp_group,
            make_sharded_tensors_for_checkpoint,
            sharded_state_dict_default,
        )

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = tp_group if tp_group is not None else ps.get_tensor_model_parallel_group()
        own: dict = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(own, prefix, {"A_log": 0, "dt_bias": 0, "conv1d_weight": 0},
                                                  sharded_offsets, tp_group=tp_group,
                                                  dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                  tp_group=tp_group))
        loc = self.local
        qkv = [loc["key_dim"], loc["key_dim"], loc["value_dim"]]
        out[f"{prefix}in_proj.weight"] = _split_tensor_factory(
            out[f"{prefix}in_proj.weight"], [*qkv, loc["value_dim"], loc["nv"], loc["nv"]],
            ["query", "key", "value", "z", "beta", "alpha"], 0)
        out[f"{prefix}conv1d_weight"] = _split_tensor_factory(out[f"{prefix}conv1d_weight"], qkv,
                                                             ["query", "key", "value"], 0)
        return out

    def _mix(self, qkv: Tensor, beta_in: Tensor, a: Tensor, cu: Tensor | None) -> Tensor:
        """conv1d + delta rule over whole sequences: the ``b`` rows of a compact batch, or the ``cu_seqlens``
        sequences of a packed ``[T, 1]`` row (regrouped to one zero-padded row each, then put back)."""
        s_len, b = qkv.shape[:2]
        if cu is None:
            rows = [t.transpose(0, 1) for t in (qkv, beta_in, a)]  # [b, s, .]
            return self._rows(*rows).transpose(0, 1)
        if b != 1:
            raise ValueError(f"a packed row has batch 1, got {b}")
        if fla_available():
            return self._fla_packed(qkv[:, 0], beta_in[:, 0], a[:, 0], cu)[:, None]
        index, valid = sequence_index(cu.to(qkv.device))
        rows = [t[:, 0][index] * valid[..., None].to(t.dtype) for t in (qkv, beta_in, a)]  # [n, Lmax, .]
        out = self._rows(*rows)  # [n, Lmax, nv, dv]
        flat = out.new_zeros(s_len, *out.shape[2:])
        flat[index[valid]] = out[valid]
        return flat[:, None]

    def _rows(self, qkv: Tensor, beta_in: Tensor, a: Tensor) -> Tensor:
        """[B, L, .] rows, each one whole sequence from its first token -> [B, L, nv_local, dv]."""
        q, k, v = self._heads(self._conv(qkv))
        return gated_delta_rule(l2_normalize(q.float()), l2_normalize(k.float()), v, self._decay(a),
                                beta_in.float().sigmoid())

    def _conv(self, qkv: Tensor) -> Tensor:
        """silu(causal depthwise conv1d) of [B, L, channels] rows, zero history before each row's first token."""
        w = self.conv1d_weight
        h = F.conv1d(F.pad(qkv.transpose(1, 2), (w.shape[-1] - 1, 0)), w, groups=w.shape[0])
        return F.silu(h).transpose(1, 2)

    def _heads(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """[B, L, q | k | v] -> q, k [B, L, nv_local, d_k] (each key head repeated for its value heads), v."""
        B, L, _ = h.shape
        loc, s = self.local, self.sizes
        q, k, v = torch.split(h, [loc["key_dim"], loc["key_dim"], loc["value_dim"]], dim=-1)
        q, k = q.reshape(B, L, loc["nk"], s["dk"]), k.reshape(B, L, loc["nk"], s["dk"])
        rep = s["nv"] // s["nk"]
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return q, k, v.reshape(B, L, loc["nv"], s["dv"])

    def _decay(self, a: Tensor) -> Tensor:
        """g = −exp(A_log) · softplus(a + dt_bias), in fp32."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def _fla_packed(self, qkv: Tensor, beta_in: Tensor, a: Tensor, cu: Tensor) -> Tensor:
        """CUDA with ``fla``: the conv per sequence (zero history at each boundary), the delta rule as one varlen
        call over the packed row. Not run on this project's CPU hosts (docs/megatron.md says so)."""
        index, valid = sequence_index(cu.to(qkv.device))
        h = self._conv(qkv[index] * valid[..., None].to(qkv.dtype))[valid]  # [T, channels]
        q, k, v = self._heads(h[None])
        o, _ = _fla_kernel()(q, k, v, g=self._decay(a)[None], beta=beta_in.float().sigmoid()[None],
                             cu_seqlens=cu.long(), use_qk_l2norm_in_kernel=True, output_final_state=False)
        return o[0]


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm storing ``γ − 1`` (Qwen3.5 / Qwen3-Next: ``y = x / rms(x) · (1 + w)``, ``w`` initialised to 0, in
    fp32, cast back). Megatron's ``layernorm_zero_centered_gamma`` exists only in Transformer Engine's norms (its
    torch norm refuses it), so the local spec gets this module, built with the norm's usual arguments."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_unused: Any) -> None:
        super().__init__()
        self.eps = eps
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)
