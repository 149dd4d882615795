"""Critic loss with value clipping and the explained-variance metric (PPO; verl's ray_trainer step; docs/driver.md)."""
from __future__ import annotations

import torch

from .agg_loss import agg_loss
from .masked import masked_var


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    global_tokens: float | torch.Tensor | None = None,
    global_seqs: float | torch.Tensor | None = None,
    norm_constant: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, as in verl / TRL's PPO trainer.

    All inputs ``[B, T]``: ``vpreds`` new predictions, ``values`` predictions at rollout time,
    ``returns`` targets. ``v_clip = clamp(vpreds, values - eps_v, values + eps_v)``;
    ``L = 0.5 * agg(max((vpreds - R)^2, (v_clip - R)^2))``.
    Returns ``(vf_loss, vf_clipfrac)``; ``vf_clipfrac`` is the token-mean of
    ``(v_clip - R)^2 > (vpreds - R)^2`` (``sum / global_tokens`` when given, like the loss).
    ``global_tokens`` / ``global_seqs`` / ``norm_constant`` go to :func:`agg_loss`;
    ``norm_constant`` is the ``C`` of ``seq-mean-token-sum-norm`` (the critic worker passes
    ``rollout.max_response_length``) and is unused by the other modes.
    """
    if cliprange_value < 0:
        raise ValueError(f"critic.cliprange_value must be >= 0, got {cliprange_value}")
    vclip = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    l1 = (vpreds - returns) ** 2
    l2 = (vclip - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(l1, l2), response_mask, loss_agg_mode,
                             global_tokens=global_tokens, global_seqs=global_seqs, norm_constant=norm_constant)
    with torch.no_grad():
        m = response_mask.to(l1.dtype)
        denom = m.sum().clamp(min=1) if global_tokens is None else global_tokens
        clipfrac = ((l2 > l1).to(l1.dtype) * m).sum() / denom
    return vf_loss, clipfrac


def explained_variance(returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[R - V] / Var[R]`` over valid tokens of ``[B, T]`` inputs (``critic/vf_explained_var``).

    1 is a perfect critic, 0 no better than the mean, negative worse. When ``Var[R] = 0`` the
    result is 1 if the residual variance is also 0 and 0 otherwise (instead of NaN / inf).
    """
    with torch.no_grad():
        var_r = masked_var(returns, response_mask)
        var_res = masked_var(returns - values, response_mask)
        if var_r <= 0:
            one = torch.ones((), dtype=returns.dtype, device=returns.device)
            return one if var_res <= 0 else torch.zeros_like(one)
        return 1.0 - var_res / var_r

