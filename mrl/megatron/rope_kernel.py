"""Rotary position embedding as one autograd function: the CPU's stand-in for Transformer Engine's
fused RoPE (Megatron's ``apply_rope_fusion`` needs TE; without it Megatron runs its unfused
``_apply_rotary_pos_emb_bshd``).

With the last dimension split in halves ``t = [t₁, t₂]`` and ``cos = [c₁, c₂]``, ``sin = [s₁, s₂]``
(Megatron's non-interleaved layout, ``rotate_half(t) = [−t₂, t₁]``)::

    y  = t·cos + rotate_half(t)·sin:   y₁ = t₁c₁ − t₂s₁,    y₂ = t₂c₂ + t₁s₂
    ∂t = (from g = ∂L/∂y):             ∂t₁ = g₁c₁ + g₂s₂,   ∂t₂ = g₂c₂ − g₁s₁

Three kernels each way (a product and two in-place ``addcmul``) where the unfused version runs ~7
forward (chunk, negate, two concatenations, products, a sum) and their backwards, and nothing of
``t``'s size is saved for backward. ``cos``/``sin`` of a frequency table are computed once per
forward for all layers (every layer rotates by the same table object). Same values as Megatron's
function to float rounding (tests/megatron/test_rope_kernel.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# (freqs, mscale, dtype, cos, sin) of the last table: the attention of every layer passes the same
# tensor for q and k. The strong reference keeps ``freqs`` alive, so identity cannot be reused; one
# tuple, replaced whole, so a reader never sees one table's cos with another's key.
_LAST: tuple[Any, ...] = (None, None, None, None, None)


class _Rotate(torch.autograd.Function):
    """The module docstring's y(t) and ∂t; ``cos``/``sin`` broadcast over ``t`` (not differentiated)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        h = t.shape[-1] // 2
        y = t * cos
        y[..., :h].addcmul_(t[..., h:], sin[..., :h], value=-1)
        y[..., h:].addcmul_(t[..., :h], sin[..., h:])
        ctx.save_for_backward(cos, sin)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        h = g.shape[-1] // 2
        dt = g * cos
        dt[..., :h].addcmul_(g[..., h:], sin[..., h:])
        dt[..., h:].addcmul_(g[..., :h], sin[..., :h], value=-1)
        return dt, None, None


def _cos_sin(freqs: Tensor, mscale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    global _LAST
    last = _LAST
    if last[0] is freqs and last[1] == mscale and last[2] == dtype:
        return last[3], last[4]
    # Megatron's rounding: cos/sin in the table's dtype, times mscale, then cast to t's dtype
    cos, sin = (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)
    _LAST = (freqs, mscale, dtype, cos, sin)
    return cos, sin


def make_rope_bshd(original):
    """A drop-in for Megatron's ``_apply_rotary_pos_emb_bshd`` that runs :class:`_Rotate`; the
    cases it does not cover (interleaved or MLA layouts, partial rotary dimensions, odd widths)
    go to ``original``."""

    def rope_bshd(t: Tensor, freqs: Tensor, rotary_interleaved: bool = False, multi_latent_attention: bool = False,
                  mscale: float = 1.0) -> Tensor:
        d = freqs.shape[-1]
        if rotary_interleaved or multi_latent_attention or d != t.shape[-1] or d % 2:
            return original(t, freqs, rotary_interleaved=rotary_interleaved,
                            multi_latent_attention=multi_latent_attention, mscale=mscale)
        cos, sin = _cos_sin(freqs, mscale, t.dtype)
        return _Rotate.apply(t, cos, sin)

    rope_bshd.mrl_original = original  # type: ignore[attr-defined]
    return rope_bshd
