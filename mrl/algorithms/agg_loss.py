"""Aggregate a token-level loss matrix ``[B, T]`` into a scalar (verl's ``agg_loss``).

Micro-batch invariance. A mini-batch is split into micro-batches (gradient accumulation) and over
DP ranks. If every call is given the same *global* denominators of the whole mini-batch,

* ``global_tokens`` = number of valid response tokens in the mini-batch (all micro-batches,
  all DP ranks), and
* ``global_seqs``   = number of sequences in the mini-batch (all micro-batches, all DP ranks),

then every mode is a plain sum of per-micro-batch terms, so summing the micro-batch losses (and the
DP ranks' sums) reproduces the full mini-batch value exactly, for values and gradients. The caller
therefore *sums* micro-batch losses, it does not average them. If the data-parallel gradient
reduction averages over ``dp_size`` ranks (Megatron DDP's default), multiply the loss by
``dp_size`` before ``backward`` to undo that average.

Without global denominators the local micro-batch counts are used, which is verl's per-call
behaviour and equals the full-batch value only for a single micro-batch.
"""
from __future__ import annotations

import torch

from .masked import masked_sum

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def count_tokens_and_seqs(loss_mask: torch.Tensor) -> tuple[int, int]:
    """Local denominators of a ``[B, T]`` mask: (valid tokens, sequences with >= 1 valid token).

    Sum these over micro-batches and DP ranks (all-reduce SUM) to get ``global_tokens`` and
    ``global_seqs`` for :func:`agg_loss`.
    """
    return int(loss_mask.sum().item()), int((loss_mask.sum(dim=-1) > 0).sum().item())


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Reduce ``loss_mat`` ``[B, T]`` under ``loss_mask`` ``[B, T]`` to a scalar.

    With ``l`` the loss, ``m`` the mask, ``n_i = sum_t m_it``, ``N`` = ``global_tokens`` (default
    ``sum m``), ``S`` = ``global_seqs`` (default: sequences with ``n_i > 0``):

    * ``token-mean``:              ``sum_it l m / N``                      (DAPO; verl default)
    * ``token-sum``:               ``sum_it l m``                          (no normaliser; verl ``token-sum``:
      the loss scale grows with the number of tokens, so the learning rate must absorb it)
    * ``seq-mean-token-sum``:      ``sum_i (sum_t l m) / S``
    * ``seq-mean-token-mean``:     ``sum_i (sum_t l m / n_i) / S``          (original GRPO)
    * ``seq-mean-token-sum-norm``: ``sum_i (sum_t l m) / (S * C)``          (Dr.GRPO)

    ``C`` (``norm_constant``) is Dr.GRPO's fixed normaliser, the generation budget (maximum
    response length); it must not depend on the data. Without it ``C`` falls back to
    ``T = loss_mask.shape[-1]``, the padded width, which changes with padding (the longest response
    of the step) and with micro-batching, so the loss is then neither Dr.GRPO's nor invariant to
    the micro-batch split. The trainer always passes ``rollout.max_response_length``
    (:class:`mrl.workers.loss.ActorLossSpec`); the default is for one-off library use only.
    Choice documented against the sources: a widely copied description of verl shows ``sum / mask.sum()`` for this mode, which
    is just ``token-mean``; verl's code divides by ``T`` only (its 1/B lives in the
    gradient-accumulation scale); we follow the Dr.GRPO paper (arXiv 2503.20783): the mean over
    sequences of token sums divided by the constant, so the scale does not grow with batch size.

    Sequences with ``n_i = 0`` contribute 0 (no NaN). Returns a 0-dim tensor.
    """
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"agg_loss: loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        denom = mask.sum().clamp(min=1) if global_tokens is None else global_tokens
        return masked_sum(loss_mat, mask) / denom
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask)

    n_per_seq = mask.sum(dim=-1)
    seqs = (n_per_seq > 0).sum().clamp(min=1) if global_seqs is None else global_seqs
    seq_sums = masked_sum(loss_mat, mask, dim=-1)  # [B]
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.sum() / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (seq_sums / n_per_seq.clamp(min=1)).sum() / seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        c = loss_mask.shape[-1] if norm_constant is None else norm_constant
        if c <= 0:
            raise ValueError(f"agg_loss: norm_constant (max_response_length) must be > 0, got {c}")
        return seq_sums.sum() / (seqs * c)
    raise ValueError(
        f"unknown loss_agg_mode {loss_agg_mode!r} (config key `loss_agg_mode`); valid: {', '.join(LOSS_AGG_MODES)}"
    )
