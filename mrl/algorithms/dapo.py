"""DAPO's two data-side pieces (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning
System at Scale"; verl ``recipe/dapo``): dynamic sampling and the overlong reward penalty.

The clip-higher and token-level-loss parts of DAPO are ``actor.clip_ratio_high`` and
``actor.loss_agg_mode=token-mean``; these two act on rewards and on which groups are trained.
"""
from __future__ import annotations

import torch

from .advantages import group_ids


def informative_groups(metric: torch.Tensor, uid: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling's filter: keep the samples of groups whose metric varies.

    ``metric`` [B] (a per-sample score, e.g. accuracy), ``uid`` [B] (samples of one prompt share
    it). A group g is kept iff ``std_g(metric) > 0`` (population std, as numpy's in verl) or it has
    a single sample: a group where every answer scored the same has zero GRPO advantage and only
    dilutes the batch. Returns a bool mask [B] (True = keep), constant within each group.
    """
    if metric.shape != uid.shape or metric.dim() != 1:
        raise ValueError(f"metric {tuple(metric.shape)} and uid {tuple(uid.shape)} must both be [B]")
    gid, n_groups = group_ids(uid)
    m = metric.double()
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, torch.ones_like(m))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, m) / count
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, (m - mean[gid]) ** 2) / count
    keep = (var > 0) | (count == 1)
    return keep[gid]


def overlong_penalty(response_length: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the outcome reward.

    With ``L_max = max_response_length``, ``L_buf = buffer_len`` and ``|y|`` the response length [B]:
    ``R_len(y) = min(-(|y| - (L_max - L_buf)) / L_buf * penalty_factor, 0)``: 0 up to
    ``L_max - L_buf`` tokens, then linearly down to ``-penalty_factor`` at ``L_max``.
    Returns [B] float32 (≤ 0).
    """
    if not 0 < buffer_len < max_response_length:
        raise ValueError(f"overlong buffer length {buffer_len} must be in (0, max_response_length={max_response_length})")
    expected = max_response_length - buffer_len
    exceed = response_length.to(torch.float32) - expected
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)
