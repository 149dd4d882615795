"""KL coefficient controllers and the KL penalty in the reward (``use_kl_in_reward``, verl's ray_trainer step; docs/driver.md)."""
from __future__ import annotations

import math

import torch

from .kl import kl_penalty as _kl_penalty
from .masked import masked_mean


class FixedKLController:
    """Constant coefficient ``beta = kl_coef``; ``update`` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for the common controller interface)."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive coefficient of Ziegler et al. 2019 (arXiv 1909.08593), as verl implements it.

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``
    where ``n_steps`` is the number of samples in the batch.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if init_kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {init_kl_coef}")
        if not target_kl > 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """One multiplicative step toward ``target_kl`` (see class docstring)."""
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update got a non-finite KL ({current_kl})")
        err = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = float(state["value"]), float(state["target"]), float(state["horizon"])


KLController = FixedKLController | AdaptiveKLController


def get_kl_controller(kind: str, kl_coef: float, target_kl: float | None = None,
                      horizon: float | None = None) -> KLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` (``fixed`` | ``adaptive``)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl and .horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type {kind!r}; valid: adaptive, fixed")


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL penalty in the reward (verl ``apply_kl_penalty``; verl's ray_trainer step; docs/driver.md). All tensors ``[B, T]``.

    ``kld = kl_penalty(old_log_prob, ref_log_prob) * m``; ``beta = kl_ctrl.value`` (before update);
    ``token_level_rewards = token_level_scores - beta * kld``;
    ``current_kl = mean_i(masked_mean_t(kld))`` (per-sequence token-mean, then mean over sequences);
    then ``kl_ctrl.update(current_kl, n_steps=B)``.
    Returns ``(token_level_rewards, {"critic/kl": current_kl, "critic/kl_coeff": beta})``.
    Worked example (tests/algorithms/test_kl_control_shaping.py): beta 0.1, d = [0.03, 0.02, 0.03, 0.02, 0.03, 0.01], scores [0,0,0,0,0,1]
    -> rewards [-0.003, -0.002, -0.003, -0.002, -0.003, 0.999].
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = _kl_penalty(old_log_prob, ref_log_prob, kl_penalty) * mask
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, mask, dim=-1).mean().item())
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"critic/kl": current_kl, "critic/kl_coeff": beta}
