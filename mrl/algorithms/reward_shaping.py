"""Reward shaping (docs/driver.md, "Reward shaping"): scheduled reference-reward blend and representation-alignment bonus.

Order in the step (docs/driver.md, "Reward shaping"): KL-in-reward first, then ``blend_ref_reward``, then
``repr_align_bonus`` is added, then advantages.
"""
from __future__ import annotations

import math

import torch

SCHEDULES: tuple[str, ...] = ("linear", "sigmoid", "cosine", "exp", "step")
_SIGMOID_K = 10.0  # steepness of the logistic ramp over [0, 1]
_EXP_K = 5.0  # growth rate of the exponential ramp over [0, 1]


def _logistic(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-_SIGMOID_K * (x - 0.5)))


def _ramp(schedule: str, p: float, steps: int) -> float:
    """Monotone map [0, 1] -> [0, 1] with f(0) = 0 and f(1) = 1."""
    if schedule == "linear":
        return p
    if schedule == "sigmoid":
        return (_logistic(p) - _logistic(0.0)) / (_logistic(1.0) - _logistic(0.0))
    if schedule == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * p))
    if schedule == "exp":
        return math.expm1(_EXP_K * p) / math.expm1(_EXP_K)
    if schedule == "step":
        return math.floor(p * steps + 1e-12) / steps
    raise ValueError(f"unknown schedule {schedule!r} (config key `schedule`); valid: {', '.join(SCHEDULES)}")


def schedule_weight(schedule: str, step: int, total_steps: int, max_weight: float,
                    warmup_ratio: float, steps: int = 3) -> float:
    """Scheduled weight ``w(step) = max_weight * f(p)``, ``p = min(step / (warmup_ratio * total_steps), 1)``.

    ``f`` (docs/driver.md, "Reward shaping"), all with ``f(0) = 0``, ``f(1) = 1``, non-decreasing:
    ``linear`` p; ``sigmoid`` logistic ``1/(1+exp(-10 (p - 1/2)))`` rescaled to hit 0 and 1 exactly
    (slow, fast, slow); ``cosine`` ``(1 - cos(pi p)) / 2``; ``exp`` ``(exp(5p) - 1) / (exp(5) - 1)``
    (very slow, then fast); ``step`` ``floor(p * steps) / steps`` (``steps`` equal stairs: ``steps + 1``
    distinct values including 0 and 1). So ``w = 0`` at step 0 and ``w = max_weight`` from the end of
    the warm-up (``warmup_ratio * total_steps``) on. ``warmup_ratio = 0`` means no warm-up:
    ``max_weight`` from step 0.
    """
    if total_steps <= 0:
        raise ValueError(f"schedule_weight: total_steps must be > 0, got {total_steps}")
    if not 0.0 <= warmup_ratio <= 1.0:
        raise ValueError(f"schedule_weight: warmup_ratio must be in [0, 1], got {warmup_ratio}")
    if step < 0:
        raise ValueError(f"schedule_weight: step must be >= 0, got {step}")
    if schedule == "step" and steps < 1:
        raise ValueError(f"schedule_weight: `steps` (stair count of the step schedule) must be >= 1, got {steps}")
    warm = warmup_ratio * total_steps
    p = 1.0 if warm <= 0 else min(step / warm, 1.0)
    return max_weight * _ramp(schedule, p, steps)


@torch.no_grad()
def blend_ref_reward(token_level_rewards: torch.Tensor, ref_log_prob: torch.Tensor,
                     response_mask: torch.Tensor, weight: float) -> torch.Tensor:
    """``(1 - w) * rewards + w * minmax(ref_log_prob) * m`` for ``[B, T]`` inputs (docs/driver.md, "Reward shaping").

    ``minmax`` is per sequence over its valid response tokens:
    ``(x - min_i) / (max_i - min_i)`` in [0, 1]. A sequence whose valid ref log-probs are all equal
    (including a single valid token, or none) has no range to normalise: its normalised score is 0,
    so it gets ``(1 - w) * rewards`` (no reference signal) instead of NaN.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"blend_ref_reward: weight must be in [0, 1] (check ref_reward_blend.max_weight), got {weight}")
    valid = response_mask.bool()
    x = ref_log_prob.to(token_level_rewards.dtype)
    lo = torch.where(valid, x, torch.full_like(x, math.inf)).amin(dim=-1, keepdim=True)
    hi = torch.where(valid, x, torch.full_like(x, -math.inf)).amax(dim=-1, keepdim=True)
    rng = hi - lo
    ok = torch.isfinite(rng) & (rng > 0)
    norm = torch.where(ok & valid, (x - lo) / torch.where(ok, rng, torch.ones_like(rng)), torch.zeros_like(x))
    return (1.0 - weight) * token_level_rewards + weight * norm


@torch.no_grad()
def repr_align_bonus(similarity: torch.Tensor, response_mask: torch.Tensor, weight: float) -> torch.Tensor:
    """Representation-alignment bonus ``w * sim_i * m_it / n_i`` ``[B, T]`` (docs/driver.md, "Reward shaping").

    ``similarity`` ``[B]`` is the cosine similarity of generated vs gold response embeddings;
    ``n_i`` the valid tokens of sequence i (a sequence with none gets 0). The bonus sums to
    ``w * sim_i`` per sequence; add it to ``token_level_rewards``.
    """
    if similarity.dim() != 1 or similarity.shape[0] != response_mask.shape[0]:
        raise ValueError(f"repr_align_bonus: similarity must be [B={response_mask.shape[0]}], got {tuple(similarity.shape)}")
    mask = response_mask.to(similarity.dtype)
    n = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return weight * similarity.unsqueeze(-1) * mask / n
