"""Hybrid models in the engine: Gated DeltaNet linear-attention layers beside full-attention layers
(Qwen3.5 / Qwen3.6 dense and MoE, Qwen3-Next; ``layer_types`` entries ``linear_attention`` / ``full_attention``).

A full-attention layer keeps K/V per token in the running set's cache as any model does. A linear-attention
layer keeps, per sequence, two fixed-size states and no K/V (transformers' ``Qwen3_5GatedDeltaNet``):

* the conv window: the last ``kernel - 1`` inputs ``x = in_proj_qkv(h)`` of the causal depthwise conv1d,
  ``[conv_dim, kernel - 1]`` (``conv_dim = 2 * heads_k * d_k + heads_v * d_v``); the step's conv output is
  ``silu(sum_j w[:, j] * [window | x_t][:, j])`` and the window shifts by one column;
* the recurrent state ``S`` ``[heads_v, d_k, d_v]`` (fp32, as transformers and SGLang keep it) of the gated
  delta rule: ``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T``, read out as
  ``o_t = S_t^T q_t / sqrt(d_k)`` (q, k L2-normalised).

Both are *row states* of :class:`~mrl.rollout.engine.kv_cache.RunningBatch` (they move with their row on
removal and are repeated for identical prompts). The decode step is the model's own forward with a
``DynamicCache(config=...)`` whose full-attention layers hold views of the live K/V columns and whose
linear-attention layers hold *views* of the row-state buffers: the forward's fused conv update
(``causal_conv1d_update``) and its ``update_recurrent_state`` write the new states in place, so nothing is
copied back for them.

Left-padded prefill is exact: transformers zeroes padded positions' hidden states before a linear layer
(``apply_mask_to_padding_states``, given the 2-D mask), so a pad feeds ``x = 0``: conv window columns of 0 (what
a fresh sequence's zero padding holds) and ``k = v = 0`` (no change to ``S = 0``; the decay of a zero state
is zero). ``tests/rollout/test_engine_hybrid.py`` checks it against unpadded forwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mrl.rollout.engine.kv_cache import RunningBatch

LINEAR = "linear_attention"
FULL = "full_attention"
RECURRENT_DTYPE = torch.float32  # transformers' delta rule returns its state in fp32 whatever the model dtype


@dataclass(frozen=True)
class HybridLayout:
    """Which decoder layers are full attention (K/V slot ``j`` = ``full[j]``) and which linear attention
    (row states ``2j`` = conv window, ``2j + 1`` = recurrent state of layer ``linear[j]``), and the state shapes."""

    full: tuple[int, ...]
    linear: tuple[int, ...]
    conv_shape: tuple[int, int]        # [conv_dim, kernel - 1]
    recurrent_shape: tuple[int, int, int]  # [heads_v, d_k, d_v]

    @classmethod
    def of(cls, config) -> HybridLayout | None:
        """The layout of a config with linear-attention layers; None for any other model."""
        cfg = config.get_text_config()  # the decoder's: a vision-language config nests it
        types = list(getattr(cfg, "layer_types", None) or [])
        if LINEAR not in types:
            return None
        unknown = sorted(set(types) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"config.json layer_types {unknown}: the engine serves hybrids of {LINEAR!r} and "
                             f"{FULL!r} layers only")
        hk, hv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
        dk, dv = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
        kernel = int(cfg.linear_conv_kernel_dim)
        return cls(full=tuple(i for i, t in enumerate(types) if t == FULL),
                   linear=tuple(i for i, t in enumerate(types) if t == LINEAR),
                   conv_shape=(2 * hk * dk + hv * dv, kernel - 1), recurrent_shape=(hv, dk, dv))

    def row_states(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of every row state, in slot order: the conv window in the model dtype (the conv's
        input), the recurrent state in fp32."""
        out: list[tuple[tuple[int, ...], torch.dtype]] = []
        for _ in self.linear:
            out += [(self.conv_shape, dtype), (self.recurrent_shape, RECURRENT_DTYPE)]
        return out

    def take_prefill(self, cache: DynamicCache, pad: torch.Tensor) -> tuple[list, list, list]:
        """(keys, values, states) of a prefilled ``cache`` in the running set's layout; ``pad`` ``[n, Lp]``
        True at padding (their K/V zeroed: a padded slot is never attended, and 0 * NaN must not leak)."""
        keys, values, states = [], [], []
        for i in self.full:
            layer = cache.layers[i]
            keys.append(layer.keys.masked_fill(pad[:, None, :, None], 0.0))
            values.append(layer.values.masked_fill(pad[:, None, :, None], 0.0))
        width = self.conv_shape[1]
        for i in self.linear:
            layer = cache.layers[i]
            # transformers keeps `kernel` columns; the oldest never reaches the next output (kernel taps over
            # window + the new input), so the last kernel - 1 columns are the whole state
            states += [layer.conv_states[0][..., -width:].contiguous(), layer.recurrent_states[0]]
        return keys, values, states


def _bind_linear(layer, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
    """Make transformers' ``LinearAttentionLayer`` hold ``conv`` / ``recurrent`` (views of the running set's
    buffers) as its decode-time states: the forward's in-place updates then land in our buffers."""
    layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
    layer.conv_kernel_size[0] = conv.shape[-1]
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.device, layer.dtype = conv.device, conv.dtype


@torch.inference_mode()
def hybrid_decode(model: torch.nn.Module, rb: RunningBatch, layout: HybridLayout) -> torch.Tensor:
    """One decode step of a hybrid model through its own forward: feeds ``rb.last_tokens`` at ``rb.next_pos``,
    writes their K/V into the cache column and updates every row's conv window and recurrent state in place;
    returns logits ``[B, V]``."""
    col = rb.reserve_column()
    cache = DynamicCache(config=model.config)
    for j, i in enumerate(layout.full):
        cache.layers[i].update(rb.keys(j), rb.values(j))
    for j, i in enumerate(layout.linear):
        _bind_linear(cache.layers[i], rb.state(2 * j), rb.state(2 * j + 1))
    mask = torch.cat([rb.valid_mask(), torch.ones(rb.size, 1, dtype=torch.long, device=rb.device)], dim=1)
    out = model(input_ids=rb.last_tokens[:, None], attention_mask=mask, position_ids=rb.next_pos[:, None],
                past_key_values=cache, use_cache=True)
    for j, i in enumerate(layout.full):
        rb.k[j][: rb.size, :, col] = cache.layers[i].keys[:, :, -1]
        rb.v[j][: rb.size, :, col] = cache.layers[i].values[:, :, -1]
    rb.bias[: rb.size, col] = 0.0
    rb.commit_column()
    return out.logits[:, -1, :]
