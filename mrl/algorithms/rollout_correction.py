"""Rollout correction: importance weights and rejection masks for the engine/trainer policy mismatch.

The rollout engine samples from ``pi_rollout`` (its kernels, precision, possibly stale weights in
off-policy training); the trainer recomputes ``pi_old`` with the training model. PPO's ratio is
taken against ``pi_old``, so the samples are off-policy by ``rho_t = pi_old(a_t) / pi_rollout(a_t)``
(``log rho = old_log_prob - rollout_log_prob``). This is *decoupled PPO* (Hilton et al. 2021,
arXiv 2110.00641): three policies, the behaviour policy (engine) for sampling, the proximal policy
(``pi_old``) as the trust-region centre, the current policy; the behaviour mismatch is corrected by
importance weights, the trust region by PPO's clip. verl's ``rollout_corr`` family (verl 0.9,
``verl/trainer/ppo/rollout_corr_helper.py``; Liu et al. 2025, "When speed kills stability",
https://richardli.xyz/rl-collapse; Yao et al. 2025 for TIS), same names and semantics:

* ``rollout_is`` = ``token``: ``w_t = rho_t``; ``sequence``: ``w_t = prod_t rho_t`` (per sequence).
  Threshold ``U`` (TIS): ``w <- min(w, U)``; ``"L_U"`` (IcePop two-sided mask): ``w <- w`` inside
  ``[L, U]``, else 0. ``rollout_is_batch_normalize``: divide by the batch mean weight (token mean,
  or the mean over sequences of the per-sequence weight). Weights are detached and multiply the
  per-token policy loss.
* ``rollout_rs`` (masked IS / rejection sampling), comma-separated options all of which must pass,
  on the statistics ``k1 = -log rho``, ``k2 = (log rho)^2 / 2``, ``k3 = rho - 1 - log rho``:
  ``token_k{1,2,3}`` per token, ``seq_sum_k*`` / ``seq_mean_k*`` / ``seq_max_k{2,3}`` per sequence
  (``seq_mean_k1`` is the geometric-mean sequence ratio ``exp(mean_t log rho)``). ``k1`` options take
  ratio bounds ``"L_U"`` (a single ``U`` means ``[1/U, U]``) and keep ``log L <= k1 <= log U``; the
  others take an upper bound. Rejected tokens (and whole sequences for ``seq_*``) leave the
  response mask, so they leave the loss and its denominators.

All tensors ``[B, T]``; computed on the whole step batch (as verl's trainer does), so the batch
statistics (normalisation, metrics) do not depend on the micro-batch split.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mrl.rollout_correction_spec import (
    IS_LEVELS,
    RS_OPTIONS,
    parse_is_threshold,
    parse_rs,
)

__all__ = [
    "IS_LEVELS",
    "RS_OPTIONS",
    "RolloutCorrection",
    "compute_offpolicy_metrics",
    "compute_rollout_correction",
    "compute_rollout_is_weights",
    "compute_rollout_rs_mask",
    "parse_is_threshold",
    "parse_rs",
]

SAFETY_BOUND = 20.0


def _mm(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Masked mean with verl's ``+ 1e-8`` denominator (0 for an empty row)."""
    return (x * mask).sum(dim) / (mask.sum(dim) + 1e-8)


def compute_rollout_is_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_is: str,
                               threshold: str | float, batch_normalize: bool = False,
                               ) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached IS weights ``[B, T]`` (0 on padding) and verl's ``rollout_is_*`` metrics (module docstring)."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS}, got {rollout_is!r}")
    upper, lower = parse_is_threshold(threshold)
    mask = response_mask.to(log_ratio.dtype)
    if rollout_is == "token":
        log_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_for_metrics = (log_ratio * mask).sum(-1, keepdim=True)
        raw = torch.exp(log_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    w = w.detach()
    m = _is_metrics(w, raw, log_for_metrics, mask, rollout_is, upper, lower)
    if batch_normalize:
        mean = _mm(w, mask) if rollout_is == "token" else (
            (_mm(w, mask, -1) * (mask.sum(-1) > 0)).sum() / (mask.sum(-1) > 0).sum().clamp(min=1e-8))
        if mean > 1e-8:
            w = w / mean
        m["rollout_is_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
    return w, m


def _is_metrics(w, raw, log_for_metrics, mask, rollout_is, upper, lower) -> dict[str, float]:
    low = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {"rollout_is_mean": float(_mm(w, mask))}
    if rollout_is == "sequence":
        m["rollout_is_max"] = math.exp(min(float(log_for_metrics.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(float(log_for_metrics.min()))
        m["rollout_is_ratio_fraction_high"] = float((log_for_metrics > math.log(upper)).float().mean())
        m["rollout_is_ratio_fraction_low"] = float((log_for_metrics < math.log(low)).float().mean())
    else:
        valid = mask.bool()
        m["rollout_is_ratio_fraction_high"] = float(_mm((raw > upper).to(mask.dtype), mask))
        m["rollout_is_ratio_fraction_low"] = float(_mm((raw < low).to(mask.dtype), mask))
        m["rollout_is_max"] = float(w.masked_fill(~valid, float("-inf")).max())
        m["rollout_is_min"] = float(w.masked_fill(~valid, float("inf")).min())
    c = w.clamp(min=0.0, max=upper)
    mean_c = _mm(c, mask)
    m["rollout_is_std"] = float(torch.sqrt((_mm(c.square(), mask) - mean_c.square()).clamp(min=0))) if mask.sum() > 1 else 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / float(_mm((c / (mean_c + 1e-8)).square(), mask))
    if lower is not None:
        m["rollout_is_oob_ratio"] = float(_mm(((raw < lower) | (raw > upper)).to(mask.dtype), mask))
    return m


def compute_rollout_rs_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str,
                            threshold: str | float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Response mask ``[B, T]`` with rejected tokens / sequences set to 0, and the rejection metrics
    ``rollout_rs_masked_fraction``, ``rollout_rs_seq_masked_fraction`` and per option
    ``rollout_rs_<opt>_{mean,masked_fraction,seq_masked_fraction}`` (verl's names)."""
    specs = parse_rs(rollout_rs, threshold)
    mask = response_mask.to(log_ratio.dtype)
    valid = mask.bool()
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
    keep_all = torch.ones_like(mask)
    seq_valid = mask.sum(-1) > 0
    m: dict[str, float] = {}
    for opt, (lower, upper) in specs.items():
        level, k = opt.rsplit("_", 1)
        tok = stats[k]
        if level == "token":
            stat = tok
        elif level == "seq_sum":
            stat = (tok * mask).sum(-1)
        elif level == "seq_mean":
            stat = _mm(tok, mask, -1)
        else:  # seq_max (0 for an empty row, as verl)
            mx = tok.masked_fill(~valid, float("-inf")).max(-1).values
            stat = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper)) if k == "k1" else stat <= upper
        if level != "token":
            keep, stat = keep.unsqueeze(-1).expand_as(valid), stat.unsqueeze(-1).expand_as(mask)
        keep_f = keep.to(mask.dtype)
        keep_all = keep_all * keep_f
        m[f"rollout_rs_{opt}_mean"] = float(_mm(stat, mask))
        m[f"rollout_rs_{opt}_masked_fraction"] = float(_mm(1 - keep_f, mask))
        seq_keep = (~(~keep & valid)).all(-1)
        m[f"rollout_rs_{opt}_seq_masked_fraction"] = (
            float(((~seq_keep) & seq_valid).sum() / seq_valid.sum()) if seq_valid.any() else 0.0)
    m["rollout_rs_masked_fraction"] = float(_mm(1 - keep_all, mask))
    m["rollout_rs_seq_masked_fraction"] = float((~((keep_all > 0.5) & valid) & valid).any(-1).float().mean())
    return (response_mask * keep_all).to(response_mask.dtype), m


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                              response_mask: torch.Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics: ``training_ppl``, ``training_log_ppl``, ``kl`` (k1 of
    KL(rollout || old)), ``k3_kl``, ``rollout_ppl``, ``rollout_log_ppl``, ``log_ppl_diff``,
    ``log_ppl_abs_diff``, ``log_ppl_diff_max``, ``log_ppl_diff_min``, ``ppl_ratio``, ``chi2_token``,
    ``chi2_seq`` (per-sequence means averaged over all rows, as verl)."""
    mask = response_mask.to(old_log_prob.dtype)
    lp_old, lp_roll = _mm(old_log_prob, mask, -1), _mm(rollout_log_prob, mask, -1)
    lr = old_log_prob - rollout_log_prob
    diff = lp_roll - lp_old
    seq_sum = (lr * mask).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-lp_old).mean()), "training_log_ppl": float((-lp_old).mean()),
        "kl": float(_mm(-lr, mask)), "k3_kl": float(_mm(torch.exp(lr) - lr - 1, mask)),
        "rollout_ppl": float(torch.exp(-lp_roll).mean()), "rollout_log_ppl": float((-lp_roll).mean()),
        "log_ppl_diff": float(diff.mean()), "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()), "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(_mm(torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_sum).mean() - 1.0),
    }


@dataclass
class RolloutCorrection:
    """Result of :func:`compute_rollout_correction`: ``weights`` ``[B, T]`` (None without
    ``rollout_is``), the response mask after rejection ``[B, T]``, metrics named ``rollout_corr/*``."""

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, float]


@torch.no_grad()
def compute_rollout_correction(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                               response_mask: torch.Tensor, *, rollout_is: str | None,
                               rollout_is_threshold: str | float, rollout_is_batch_normalize: bool = False,
                               rollout_rs: str | None = None, rollout_rs_threshold: str | float | None = None,
                               ) -> RolloutCorrection:
    """IS weights, rejection mask and metrics from ``log rho = old_log_prob - rollout_log_prob``
    (verl ``compute_rollout_correction_and_rejection_mask``; module docstring for the math)."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} must match")
    if not bool(response_mask.any()):
        raise ValueError("rollout correction: the response mask has no valid token")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, m = compute_rollout_is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold,
                                                rollout_is_batch_normalize)
        metrics |= m
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, m = compute_rollout_rs_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics |= m
    metrics |= compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)
    return RolloutCorrection(weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()})
