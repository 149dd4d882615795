"""Policy-gradient losses behind one registry (``get_policy_loss_fn`` / ``register_policy_loss``).

Every registered function has the same signature so the Megatron ``loss_func`` can call any of
them::

    fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low,
       clip_ratio_high, clip_ratio_c, rollout_log_probs=None, tis_imp_ratio_cap=None,
       global_tokens=None, global_seqs=None, norm_constant=None, rollout_is_weights=None,
       loss_params=None) -> PolicyLossOutput

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
The general form is verl's rollout correction (:mod:`mrl.algorithms.rollout_correction`): its detached
``rollout_is_weights`` ``[B, T]`` multiply the token losses the same way (verl's
``rollout_is_weights`` argument; GMPO first takes their per-sequence geometric mean).

``loss_params`` (:class:`PolicyLossParams`) carries the hyper-parameters of the losses that have
their own (SAPO's temperatures, Clip-Cov / KL-Cov's ratios and bounds), named as verl names them.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .agg_loss import agg_loss
from .masked import masked_mean
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


@dataclass(frozen=True)
class PolicyLossParams:
    """Loss-specific hyper-parameters, verl's names (``actor.tau_pos`` / ``actor.tau_neg``,
    ``actor.policy_loss.{clip_cov_*, kl_cov_ratio, ppo_kl_coef}``); built from the config by
    :meth:`mrl.workers.loss.ActorLossSpec.from_config`, so no default is repeated here."""

    tau_pos: float
    tau_neg: float
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    ppo_kl_coef: float


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
        rollout_is_weights: torch.Tensor | None = None,
        loss_params: PolicyLossParams | None = None,
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
                  global_tokens, global_seqs, norm_constant, rollout_is_weights=None) -> torch.Tensor:
    """``agg_loss`` of the per-token losses, each first weighted by its truncated IS ratio and by
    the rollout-correction weight when on."""
    pg_losses = _apply_is_weights(pg_losses, old_log_prob, rollout_log_probs, cap, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                    norm_constant=norm_constant)


def _apply_is_weights(pg_losses, old_log_prob, rollout_log_probs, cap, rollout_is_weights):
    w = _tis_weight(old_log_prob, rollout_log_probs, cap)
    if w is not None:
        pg_losses = pg_losses * w
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    return pg_losses


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


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
    norm_constant=None, rollout_is_weights=None, loss_params=None,
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
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
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
    norm_constant=None, rollout_is_weights=None, loss_params=None,
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
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
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
    norm_constant=None, rollout_is_weights=None, loss_params=None,
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
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
    zero = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)
    return PolicyLossOutput(pg_loss, zero, _token_mean(-log_ratio.detach(), response_mask, global_tokens), zero.clone())


# ---- losses added for verl parity (verl 0.9 ``core_algos``; oracle: tests/algorithms/oracle/) ----------------


def _need_params(loss_params: PolicyLossParams | None, loss: str) -> PolicyLossParams:
    if loss_params is None:
        raise ValueError(f"policy loss {loss!r} needs loss_params (PolicyLossParams from the actor config), got None")
    return loss_params


def _clamped_log_ratio(log_prob, old_log_prob):
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None, rollout_is_weights=None, loss_params=None,
) -> PolicyLossOutput:
    """CISPO: clipped IS-weight policy optimisation (MiniMax-M1, arXiv 2506.13585; verl ``cispo``).

    ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``; ``L = -sg(clip(r, 1 - low, 1 + high)) A log_prob``,
    so the gradient ``-sg(clip(r)) A grad(log_prob)`` never vanishes: unlike PPO, clipped tokens still
    contribute, only their weight is bounded. ``pg_clipfrac`` = token-mean of ``r != clip(r)``;
    ``clip_ratio_c`` unused, ``pg_clipfrac_lower`` 0.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = -clipped.detach() * advantages * log_prob
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
    return PolicyLossOutput(
        pg_loss, _token_mean((ratio != clipped).to(log_prob.dtype), response_mask, global_tokens),
        _token_mean(-log_ratio.detach(), response_mask, global_tokens), _zero(log_prob))


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low=0.0, clip_ratio_high=0.0,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None, rollout_is_weights=None, loss_params=None,
) -> PolicyLossOutput:
    """SAPO: soft adaptive policy optimisation (Gao et al. 2025, arXiv 2511.20347; verl ``sapo``).

    A smooth gate replaces the hard clip: ``f(r) = sigmoid(tau (r - 1)) 4 / tau`` with ``tau = tau_pos``
    for ``A > 0`` and ``tau_neg`` otherwise (``loss_params``), ``L = -f(r) A`` (``f'(1) = 1``: on-policy
    it is the plain policy gradient; far from 1 the gradient decays instead of being cut). verl
    always aggregates SAPO with ``seq-mean-token-mean``; mrl uses ``loss_agg_mode`` and `mrl plan`
    requires it to be ``seq-mean-token-mean`` (no silent override). Clip arguments unused; clip fractions 0.
    """
    p = _need_params(loss_params, "sapo")
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.as_tensor(p.tau_pos, dtype=advantages.dtype, device=advantages.device),
                      torch.as_tensor(p.tau_neg, dtype=advantages.dtype, device=advantages.device))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
    return PolicyLossOutput(pg_loss, _zero(log_prob), _token_mean(-log_ratio.detach(), response_mask, global_tokens),
                            _zero(log_prob))


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low=0.0, clip_ratio_high=0.0,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None, rollout_is_weights=None, loss_params=None,
) -> PolicyLossOutput:
    """GPG: group policy gradient (Chu et al. 2025, arXiv 2504.02546; verl ``gpg``), ``L = -A log_prob``.

    No ratio and no clip (pair it with the ``gpg`` advantage estimator). ``ppo_kl`` is still reported
    (token-mean of ``old_log_prob - log_prob``) as a drift diagnostic; clip fractions are 0.
    """
    pg_losses = -log_prob * advantages
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
    return PolicyLossOutput(pg_loss, _zero(log_prob),
                            _token_mean((old_log_prob - log_prob).detach(), response_mask, global_tokens), _zero(log_prob))


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None, rollout_is_weights=None, loss_params=None,
) -> PolicyLossOutput:
    """GMPO: geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673; verl ``geo_mean``).

    With ``d_t = log_prob - old_log_prob`` (not clamped, as verl), token-level clipping in log space
    ``d'_t = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -low, high))``, the sequence ratio is the
    geometric mean ``rho_i = exp(sum_t m d'_t / n_i)`` and ``A_i = sum_t m A / n_i`` (sequence-level
    advantages); ``L = sum_i -A_i rho_i / S`` over sequences with ``n_i > 0`` (``S`` = ``global_seqs``).
    verl divides by the micro-batch row count ``B`` (``torch.mean``), equal when no row is empty; the
    global ``S`` keeps micro-batch invariance. Token IS weights (TIS cap, rollout correction) enter
    as their per-sequence geometric mean ``exp(sum_t m log(w + 1e-10) / n_i)``, as verl.
    ``loss_agg_mode`` is not used (verl neither); `mrl plan` requires ``seq-mean-token-mean``.
    ``pg_clipfrac`` / ``pg_clipfrac_lower``: token-mean of clipped tokens with ``A > 0`` / ``A < 0``.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    mask = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    log_ratio_min = sgn * torch.minimum(sgn * log_ratio, sgn * log_ratio_clamped)
    n = mask.sum(-1)
    ratio = torch.exp((log_ratio_min * mask).sum(-1) / (n + 1e-8))
    adv = (advantages * mask).sum(-1) / (n + 1e-8)
    pg_losses = -adv * ratio
    w = _apply_is_weights(torch.ones_like(log_prob), old_log_prob, rollout_log_probs, tis_imp_ratio_cap,
                          rollout_is_weights)
    if rollout_is_weights is not None or tis_imp_ratio_cap is not None:
        pg_losses = pg_losses * torch.exp((torch.log(w + 1e-10) * mask).sum(-1) / (n + 1e-8))
    seqs = (n > 0).to(log_prob.dtype)
    denom = seqs.sum().clamp(min=1) if global_seqs is None else global_seqs
    pg_loss = (pg_losses * seqs).sum() / denom
    clipped = (log_ratio != log_ratio_clamped).to(log_prob.dtype)
    return PolicyLossOutput(
        pg_loss, _token_mean(clipped * (advantages > 0), response_mask, global_tokens),
        _token_mean(-log_ratio.detach(), response_mask, global_tokens),
        _token_mean(clipped * (advantages < 0), response_mask, global_tokens))


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None, rollout_is_weights=None, loss_params=None,
) -> PolicyLossOutput:
    """Clip-Cov (Cui et al. 2025, "The entropy mechanism of RL for reasoning LMs", arXiv 2505.22617; verl ``clip_cov``).

    PPO clip (``r = exp(log_prob - old_log_prob)``, not clamped, as verl) plus: among valid tokens the
    PPO clip did not already clip, those whose centred covariance
    ``cov_t = (A_t - mean(A)) (log_prob_t - mean(log_prob))`` (micro-batch means) lies in
    ``(clip_cov_lb, clip_cov_ub)`` are candidates, and ``max(1, int(clip_cov_ratio * #valid))`` of them,
    drawn at random (``torch.randperm``, the global CPU generator, as verl), get no gradient (loss 0).
    ``pg_clipfrac`` = token-mean of the dropped tokens; ``pg_clipfrac_lower`` 0; no dual clip.
    """
    p = _need_params(loss_params, "clip_cov")
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    valid = response_mask > 0
    with torch.no_grad():
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob.detach() - masked_mean(log_prob.detach(), response_mask))
        cov = cov.masked_fill(~valid | ((losses2 > losses1) & valid), -torch.inf)
        clip_num = max(int(p.clip_cov_ratio * response_mask.sum().item()), 1)
        cand = torch.nonzero((cov < p.clip_cov_ub) & (cov > p.clip_cov_lb) & valid)
        if len(cand) > 0:
            cand = cand[torch.randperm(len(cand))[: min(clip_num, len(cand))]]
        corr = torch.ones_like(advantages)
        corr[cand[:, 0], cand[:, 1]] = 0
    pg_losses = torch.maximum(losses1, losses2) * corr
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
    return PolicyLossOutput(pg_loss, _token_mean((corr == 0).to(log_prob.dtype), response_mask, global_tokens),
                            _token_mean(-log_ratio.detach(), response_mask, global_tokens), _zero(log_prob))


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low=0.0, clip_ratio_high=0.0,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None, rollout_is_weights=None, loss_params=None,
) -> PolicyLossOutput:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617; verl ``kl_cov``): unclipped ``L = -A r`` plus, on the
    ``max(1, int(kl_cov_ratio * #valid))`` valid tokens of largest covariance
    ``(A_t - mean A)(log_prob_t - mean log_prob)`` (micro-batch means), a penalty
    ``ppo_kl_coef |log_prob - old_log_prob|``. ``ppo_kl`` is the token-mean of ``|log r|`` (verl's
    metric for this loss); ``pg_clipfrac`` the fraction of penalised tokens; clip arguments unused.
    """
    p = _need_params(loss_params, "kl_cov")
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    valid = response_mask > 0
    sel = torch.zeros_like(valid)
    with torch.no_grad():
        flat_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        if flat_idx.numel() > 0:
            a, lp = advantages[valid].detach().reshape(-1), log_prob[valid].detach().reshape(-1)
            cov = (a - a.mean()) * (lp - lp.mean())
            k = max(1, int(len(cov) * p.kl_cov_ratio))
            sel.view(-1)[flat_idx[torch.topk(cov, k, largest=True).indices]] = True
    pg_losses = torch.where(sel, losses1 + p.ppo_kl_coef * abs_kl, losses1)
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
    return PolicyLossOutput(pg_loss, _token_mean(sel.to(log_prob.dtype), response_mask, global_tokens),
                            _token_mean(abs_kl.detach(), response_mask, global_tokens), _zero(log_prob))


def _dppo(old_log_prob, log_prob, advantages, response_mask, valid_fn, *, loss_agg_mode, clip_ratio_low,
          clip_ratio_high, clip_ratio_c, rollout_log_probs, tis_imp_ratio_cap, global_tokens, global_seqs,
          norm_constant, rollout_is_weights) -> PolicyLossOutput:
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    if clip_ratio_c is None or clip_ratio_c <= 0:
        raise ValueError(f"DPPO truncates the ratio at actor.clip_ratio_c, which must be > 0, got {clip_ratio_c}")
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    valid = valid_fn(prob, old_prob).detach().to(log_prob.dtype)
    pg_losses = -advantages * truncated * log_prob * valid
    pg_loss = _weighted_agg(pg_losses, old_log_prob, rollout_log_probs, tis_imp_ratio_cap, response_mask,
                            loss_agg_mode, global_tokens, global_seqs, norm_constant, rollout_is_weights)
    return PolicyLossOutput(
        pg_loss, _token_mean(1.0 - valid, response_mask, global_tokens),
        _token_mean(-log_ratio.detach(), response_mask, global_tokens),
        _token_mean((ratio > clip_ratio_c).to(log_prob.dtype) * valid, response_mask, global_tokens))


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None, rollout_is_weights=None, loss_params=None,
) -> PolicyLossOutput:
    """DPPO-Binary-TV: divergence-based trust region (arXiv 2602.04879; verl ``dppo_tv``).

    ``clip_ratio_low`` / ``clip_ratio_high`` are *probability-difference* thresholds here, not ratio
    epsilons: a token is kept when ``p - p_old <= high`` (``A > 0``) or ``p - p_old >= -low``
    (``A <= 0``), ``p = exp(log_prob)``. ``L = -A sg(min(r, clip_ratio_c)) log_prob kept`` (a
    truncated-IS policy gradient instead of dual clip; the paper recommends a large ``clip_ratio_c``
    such as 20). ``pg_clipfrac`` = fraction dropped, ``pg_clipfrac_lower`` = fraction kept with ``r > c``.
    """
    def valid_fn(prob, old_prob):
        return torch.where(advantages > 0, (prob - old_prob) <= clip_ratio_high, (prob - old_prob) >= -clip_ratio_low)

    return _dppo(old_log_prob, log_prob, advantages, response_mask, valid_fn, loss_agg_mode=loss_agg_mode,
                 clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                 rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                 global_tokens=global_tokens, global_seqs=global_seqs, norm_constant=norm_constant,
                 rollout_is_weights=rollout_is_weights)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, rollout_log_probs=None, tis_imp_ratio_cap=None, global_tokens=None, global_seqs=None,
    norm_constant=None, rollout_is_weights=None, loss_params=None,
) -> PolicyLossOutput:
    """DPPO-Binary-KL (arXiv 2602.04879; verl ``dppo_kl``): as ``dppo_tv`` with the binary KL
    ``D = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))`` as the
    divergence: kept when ``D <= high or p <= p_old`` (``A > 0``), ``D <= low or p >= p_old`` (else).
    """
    def valid_fn(prob, old_prob):
        d = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        return torch.where(advantages > 0, (d <= clip_ratio_high) | (prob <= old_prob),
                           (d <= clip_ratio_low) | (prob >= old_prob))

    return _dppo(old_log_prob, log_prob, advantages, response_mask, valid_fn, loss_agg_mode=loss_agg_mode,
                 clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                 rollout_log_probs=rollout_log_probs, tis_imp_ratio_cap=tis_imp_ratio_cap,
                 global_tokens=global_tokens, global_seqs=global_seqs, norm_constant=norm_constant,
                 rollout_is_weights=rollout_is_weights)
