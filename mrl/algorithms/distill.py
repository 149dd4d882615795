"""On-policy distillation: the student samples, a frozen teacher scores the student's own tokens
(Agarwal et al. 2024 "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes";
the per-token reverse-KL reward of Thinking Machines' "On-Policy Distillation", 2025). All inputs are
``[B, T]`` log-probs of the *sampled* tokens and the response mask; see docs/distillation.md.

With ``d_t = log π_s(a_t|s_t) − log π_t(a_t|s_t)`` and ``a_t ~ π_s``, ``E[d_t] = KL(π_s(·|s_t) ‖ π_t(·|s_t))``,
the reverse KL: mode-seeking, so the student concentrates on what the teacher finds likely.
"""
from __future__ import annotations

import torch

from .kl import kl_penalty
from .masked import masked_mean

Tensor = torch.Tensor


def reverse_kl_reward(student_log_prob: Tensor, teacher_log_prob: Tensor, response_mask: Tensor,
                      coef: float) -> Tensor:
    """Per-token distillation reward ``r_t = −coef · (log π_s(a_t|s_t) − log π_t(a_t|s_t)) · mask_t`` [B, T].

    Added to the task's token rewards before the advantage estimator: a policy-gradient step on it
    lowers the reverse KL to the teacher (its expectation under π_s is ``−coef · KL(π_s ‖ π_t)``).
    ``student_log_prob`` is log π_old, the policy that sampled (a reward is a constant of the update)."""
    if coef <= 0:
        raise ValueError(f"algorithm.distill.coef must be > 0, got {coef}")
    return -coef * (student_log_prob - teacher_log_prob) * response_mask.to(student_log_prob.dtype)


def teacher_kl(log_prob: Tensor, teacher_log_prob: Tensor, estimator: str) -> Tensor:
    """Token-level estimate of KL(π_θ ‖ π_t) [B, T] for the loss term ``coef · agg(teacher_kl)``: the reference-KL
    estimators of :func:`mrl.algorithms.kl.kl_penalty` with the teacher in the reference's place
    (k1 ``d``, k2 ``d²/2``, k3 ``exp(−d) + d − 1``; ``+``: straight-through k2 gradient), ``d = log π_θ − log π_t``."""
    return kl_penalty(log_prob, teacher_log_prob, estimator)


def distill_metrics(student_log_prob: Tensor, teacher_log_prob: Tensor, response_mask: Tensor) -> dict[str, float]:
    """``distill/reverse_kl``: token mean of ``d_t`` (k1: the sampled estimate of KL(π_s ‖ π_t));
    ``distill/teacher_logp``: token mean of log π_t(a_t|s_t); ``distill/student_logp`` likewise for π_s."""
    mask = response_mask.to(student_log_prob.dtype)
    return {"distill/reverse_kl": float(masked_mean(student_log_prob - teacher_log_prob, mask)),
            "distill/teacher_logp": float(masked_mean(teacher_log_prob, mask)),
            "distill/student_logp": float(masked_mean(student_log_prob, mask))}
