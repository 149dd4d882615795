"""Policy-gradient losses behind one registry (``get_policy_loss_fn`` / ``register_policy_loss``).

Every registered function has the same signature so the Megatron ``loss_func`` can call any of
them::

    fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low,
       clip_ratio_high, clip_ratio_c, rollout_log_probs=None, tis_imp_ratio_cap=None,
       global_tokens=None, global_seqs=None, norm_constant=None) -> PolicyLossOutput

All tensors are ``[B, T]`` over response tokens. ``pg_loss`` is aggregated by :func:`agg_loss`
(pass the mini-batch's global denominators and *sum* micro-batch losses). ``norm_constant`` is
Dr.GRPO's ``C`` of ``seq-mean-token-sum-norm`` (unused by the other modes): the trainer passes
``rollout.max_response_length`` so the loss does not depend on the padded width ``T``.
The metrics are token-means of indicators / log-ratios over valid tokens: with ``global_tokens`` they are
``sum / global_tokens`` so that summing them over micro-batches and DP ranks gives the mini-batch
token-mean, exactly like the loss; without it they are the local token-mean, to be weighted by the
micro-batch's token count when the caller combines micro-batches.

Truncated importance sampling (TIS) for the train/rollout mismatch is an option of every loss:
with ``rollout_log_probs`` (log-probs the inference engine reported) and ``tis_imp_ratio_cap``,
the token losses are multiplied by ``sg(min(exp(old_log_prob - rollout_log_probs), cap))``
(Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .agg_loss import agg_loss
from .registry import Registry


@dataclass
class PolicyLossOutput:
    """Result of a policy loss. ``pg_loss`` carries the graph; the metrics are detached 0-dim tensors.

    * ``pg_clipfrac``: fraction of valid tokens where the clipped term was chosen.
    * ``ppo_kl``: token-mean of ``old_log_prob - log_prob`` (approximate KL(old || new)).
    * ``pg_clipfrac_lower``: fraction of valid tokens where the dual-clip bound ``-A * c`` bound.
    """

    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    ppo_kl: torch.Tensor
    pg_clipfrac_lower: torch.Tensor


class PolicyLossFn(Protocol):
    """Uniform policy-loss signature (see the module docstring); tensors ``[B, T]``."""

    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        loss_agg_mode: str,
        clip_ratio_low: float,
        clip_ratio_high: float,
        clip_ratio_c: float | None,
        rollout_log_probs: torch.Tensor | None = None,
        tis_imp_ratio_cap: float | None = None,
        global_tokens: float | torch.Tensor | None = None,
        global_seqs: float | torch.Tensor | None = None,
        norm_constant: float | None = None,
    ) -> PolicyLossOutput: ...


_POLICY_LOSSES: Registry[Callable[..., PolicyLossOutput]] = Registry("policy loss", "actor.policy_loss")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``; duplicates are refused."""
    return _POLICY_LOSSES.register(name)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; an unknown name lists the valid ones."""
    return _POLICY_LOSSES.get(name)


def policy_loss_names() -> list[str]:
    """Registered policy-loss names."""
    return _POLICY_LOSSES.names()


def _token_mean(x: torch.Tensor, mask: torch.Tensor, global_tokens) -> torch.Tensor:
    """Metric aggregation: ``sum(x m) / global_tokens`` (or local token count), detached."""
    with torch.no_grad():
        m = mask.to(x.dtype)
        denom = m.sum().clamp(min=1) if global_tokens is None else global_tokens
        return (x * m).sum() / denom


def _tis_weight(old_log_prob, rollout_log_probs, cap) -> torch.Tensor | None:
    if cap is None:
        return None
    if rollout_log_probs is None:
        raise ValueError(
            "tis_imp_ratio_cap is set but rollout_log_probs is None: the rollout engine must return "
            "log-probs (rollout `return_logprob`), or unset `actor.tis_imp_ratio_cap`"
        )
    if cap <= 0:
        raise ValueError(f"actor.tis_imp_ratio_cap must be > 0, got {cap}")
    with torch.no_grad():
        return torch.exp(torch.clamp(old_log_prob - rollout_log_probs, -20.0, 20.0)).clamp(max=cap)


def _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, cap, response_mask, loss_agg_mode,
                  global_tokens, global_seqs, norm_constant) -> torch.Tensor:
    """``agg_loss`` of the per-token losses, each first weighted by its truncated IS ratio when on."""
    w = _tis_weight(old_log_prob, rollout_log_probs, cap)
    if w is not None:
        pg_losses = pg_losses * w
    return agg_loss(pg_losses, response_mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_constant=norm_constant)


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None) -> None:
    if not (0.0 <= clip_ratio_low < 1.0) or clip_ratio_high < 0.0:
        raise ValueError(
            f"need 0 <= actor.clip_ratio_low < 1 and actor.clip_ratio_high >= 0, "
            f"got {clip_ratio_low}, {clip_ratio_high}"
        )
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c (dual-clip bound) must be > 1.0 or null, got {clip_ratio_c}")


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    clip_ratio_c, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None,
) -> PolicyLossOutput:
    """PPO clip with asymmetric range and dual clip (Schulman et al. 2017; Ye et al. 2019, arXiv 1912.09729).

    ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` ``[B, T]``;
    ``L1 = -A r``, ``L2 = -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)``, ``L = max(L1, L2)``;
    for ``A < 0`` and ``clip_ratio_c = c`` set, ``L = min(L, -A c)`` (dual clip, as verl).
    ``pg_clipfrac`` = token-mean of ``L2 > L1``; ``pg_clipfrac_lower`` = token-mean of
    ``(A < 0) & (max(L1, L2) > -A c)``. Worked example (tests/algorithms/test_policy_loss.py): loss -0.0747.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(losses1, losses2)
    if clip_ratio_c is not None:
        losses3 = -advantages * clip_ratio_c
        neg = advantages < 0
        pg_losses = torch.where(neg, torch.minimum(clipped, losses3), clipped)
        lower = (neg & (clipped > losses3)).to(log_prob.dtype)
    else:
        pg_losses = clipped
        lower = torch.zeros_like(log_prob)
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant)
    return PolicyLossOutput(
        pg_loss=pg_loss,
        pg_clipfrac=_token_mean((losses2 > losses1).to(log_prob.dtype), response_mask, global_tokens),
        ppo_kl=_token_mean(-log_ratio.detach(), response_mask, global_tokens),
        pg_clipfrac_lower=_token_mean(lower, response_mask, global_tokens),
    )


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None,
) -> PolicyLossOutput:
    """GSPO: sequence-level importance ratio (Zheng et al. 2025, arXiv 2507.18071), as verl computes it.

    ``log s_i = sum_t m (log_prob - old_log_prob) / n_i`` ``[B]``; per token
    ``log s_it = sg(log s_i) + log_prob - sg(log_prob)`` (value ``s_i``, gradient of the token's own
    log-prob), clamped to <= 10; ``L = max(-A s_it, -A clip(s_it, 1 - low, 1 + high))``.
    ``clip_ratio_c`` is ignored (no dual clip), ``pg_clipfrac_lower`` is 0. verl hard-codes
    ``seq-mean-token-mean`` aggregation here; we honour ``loss_agg_mode`` so that micro-batch
    denominators stay consistent, and recommend ``seq-mean-token-mean`` in the config.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)
    losses1 = -advantages * s
    losses2 = -advantages * torch.clamp(s, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(losses1, losses2)
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant)
    return PolicyLossOutput(
        pg_loss=pg_loss,
        pg_clipfrac=_token_mean((losses2 > losses1).to(log_prob.dtype), response_mask, global_tokens),
        ppo_kl=_token_mean(-log_ratio.detach(), response_mask, global_tokens),
        pg_clipfrac_lower=torch.zeros((), dtype=log_prob.dtype, device=log_prob.device),
    )


@register_policy_loss("reinforce")
def compute_policy_loss_reinforce(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low=0.0, clip_ratio_high=0.0,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None,
) -> PolicyLossOutput:
    """Importance-weighted REINFORCE without ratio clipping (Williams 1992).

    ``L = -A * exp(clamp(log_prob - old_log_prob, -20, 20))`` ``[B, T]``; its gradient is
    ``-A r grad(log_prob)``, which on-policy (``r = 1``) is the REINFORCE gradient
    ``-A grad(log_prob)``. Clip arguments are accepted for the uniform signature and ignored;
    clip fractions are 0.
    """
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    pg_losses = -advantages * torch.exp(log_ratio)
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return PolicyLossOutput(pg_loss, zero, _token_mean(-log_ratio.detach(), response_mask, global_tokens), zero.clone())
