"""Masked reductions over response tokens.

All tensors are ``[B, T]`` (sequences x response tokens) unless stated; ``mask`` is 1 on valid
response tokens and 0 on padding (and on observation tokens in multi-turn rollouts).
"""
from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all dims when None)."""
    prod = x * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask) / max(sum(mask), 1)`` over ``dim``; an all-masked row gives 0, not NaN."""
    return masked_sum(x, mask, dim) / mask.sum(dim=dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Scalar variance of the valid entries of ``x``; Bessel-corrected (n / (n - 1)) like verl's
    ``masked_var`` when ``unbiased`` and more than one entry is valid."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n > 1:
            var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whiten over all valid entries: ``(x - mean) / sqrt(var + eps)`` (unbiased var, as verl).

    With ``shift_mean=False`` the mean is added back (scale only). Output is ``[B, T]``, not masked.
    Two full-size temporaries (the centred copy and its masked square), reused in place, because at
    100k x 1k tokens each temporary is 400 MB.
    """
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    centred = x - mean
    ss = torch.mul(centred, m).mul_(centred).sum()
    var = ss / n.clamp(min=1)
    if n > 1:
        var = var * n / (n - 1)
    out = centred.mul_(torch.rsqrt(var + eps))
    return out if shift_mean else out.add_(mean)
