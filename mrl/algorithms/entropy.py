"""Categorical entropy of the policy from logits, ``H = -sum_v p_v log p_v``.

Feeds the entropy bonus ``- entropy_coeff * H`` of the actor loss (verl's Megatron actor) and the
``actor/entropy`` metric (verl). For a vocabulary-parallel (TP-sharded) vocabulary the
Megatron layer computes the reductions across ranks; these functions take the full vocabulary.
"""
from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``[...]`` of ``softmax(logits)`` for ``logits`` ``[..., V]``.

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, stable for large logits (no ``log`` of a
    probability that underflowed to 0); same formula as verl's ``entropy_from_logits``.
    """
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


class _ChunkedEntropy(torch.autograd.Function):
    """Forward and backward one chunk of rows at a time, so at most one chunk of probabilities
    ``[chunk, V]`` is alive; nothing but the input logits is saved for backward.

    Gradient: ``dH/dz_v = -p_v (log p_v + H)``.
    """

    @staticmethod
    def forward(ctx, logits2d: torch.Tensor, chunk_size: int) -> torch.Tensor:  # type: ignore[override]
        out = torch.empty(logits2d.shape[0], dtype=logits2d.dtype, device=logits2d.device)
        for s in range(0, logits2d.shape[0], chunk_size):
            out[s:s + chunk_size] = entropy_from_logits(logits2d[s:s + chunk_size])
        ctx.save_for_backward(logits2d, out)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        logits2d, ent = ctx.saved_tensors
        grad = torch.empty_like(logits2d)
        cs = ctx.chunk_size
        for s in range(0, logits2d.shape[0], cs):
            logp = torch.log_softmax(logits2d[s:s + cs], dim=-1)
            grad[s:s + cs] = -(logp.exp() * (logp + ent[s:s + cs, None])) * grad_out[s:s + cs, None]
        return grad, None


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Same value and gradient as :func:`entropy_from_logits` for ``logits`` ``[..., V]``, computed
    over ``chunk_size`` rows (tokens) at a time: peak extra memory is one ``[chunk_size, V]``
    probability block instead of ``[B*T, V]``, in forward and in backward.
    """
    if chunk_size <= 0:
        raise ValueError(f"entropy chunk_size must be > 0, got {chunk_size}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedEntropy.apply(flat, chunk_size).reshape(lead)
