"""Advantage estimators behind one registry (``get_adv_estimator`` / ``register_adv_est``).

Every estimator has the same signature so the driver can call any of them::

    fn(token_level_rewards, response_mask, *, index=None, values=None, reward_baselines=None,
       gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, epsilon=1e-6) -> (advantages, returns)

``token_level_rewards``, ``response_mask``, ``values``, ``advantages`` and ``returns`` are
``[B, T]`` (B samples = prompts x n, T response tokens); ``index`` ``[B]`` is the prompt uid of each
sample (numpy array of str/int, list, or integer tensor); ``reward_baselines`` ``[B]`` is ReMax's
greedy-sample reward. Arguments an estimator does not use are ignored; a missing required one is an
error naming it. The driver also passes the batch's non-tensor fields ``extra_info`` (list of
the prompts' ``extra_info`` dicts), ``data_source`` (list of str) and ``reward_extra_info`` (dict
of the scorer's extra keys -> [B] values) by keyword, to an estimator whose signature names them
(or takes ``**kwargs``): a plugin estimator reads per-sample inputs such as a difficulty there. Outputs are 0 outside ``response_mask`` and are computed without gradient.
Masks are binary (0/1), as verl's response masks are.

Everything is vectorised over samples: groups are formed with ``numpy.unique``/``torch.unique`` and
reduced with ``index_add_``; the GAE / discounted-return recursions over time are blockwise GEMM
scans on cache-sized row chunks (:mod:`mrl.algorithms.scan`), with no Python loop over samples or
time steps. Timings: ``benchmarks/adv_estimators.py`` and docs/algorithms.md.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from .registry import Registry
from .scan import (
    discounted_scan,
    empty_output,
    gae_scan,
    moments_to_mean_rstd,
    whiten_with_moments,
)


class AdvEstimatorFn(Protocol):
    """Uniform estimator signature (see the module docstring); returns ``(advantages, returns)`` ``[B, T]``."""

    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        index: np.ndarray | Sequence | torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        reward_baselines: torch.Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
        norm_adv_by_std_in_grpo: bool = True,
        epsilon: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


_ADV: Registry[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = Registry(
    "advantage estimator", "algorithm.adv_estimator"
)


def register_adv_est(name: str) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator under ``name``; duplicates are refused."""
    return _ADV.register(name)


register_adv_estimator = register_adv_est  # verl's spelling of the decorator


def get_adv_estimator(name: str) -> AdvEstimatorFn:
    """The estimator registered as ``name``; an unknown name lists the valid ones."""
    return _ADV.get(name)


def adv_estimator_names() -> list[str]:
    """Registered estimator names."""
    return _ADV.names()


def _require(x, what: str, estimator: str):
    if x is None:
        raise ValueError(f"advantage estimator {estimator!r} needs `{what}`, which was not given")
    return x


def _row_times_mask(per_row: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``out[i, t] = per_row[i] * m_it`` ``[B, T]``, written once into a fresh output (see
    :func:`mrl.algorithms.scan.empty_output`)."""
    out = empty_output(tuple(response_mask.shape), per_row, torch.promote_types(per_row.dtype, response_mask.dtype))
    return torch.mul(per_row.unsqueeze(-1), response_mask, out=out)


def group_ids(index: np.ndarray | Sequence | torch.Tensor, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map uids ``[B]`` to dense group ids ``[B]`` (int64) and the number of groups G, vectorised."""
    if isinstance(index, torch.Tensor):
        _, inv = torch.unique(index, return_inverse=True)
        inv = inv.to(torch.long)
    else:
        _, inv_np = np.unique(np.asarray(index), return_inverse=True)
        inv = torch.from_numpy(inv_np.reshape(-1).astype(np.int64))
    inv = inv.to(device) if device is not None else inv
    return inv, int(inv.max().item()) + 1 if inv.numel() else 0


def group_mean_std(scores: torch.Tensor, index, *, singleton_mean: float = 0.0, singleton_std: float = 1.0):
    """Per-sample group statistics of ``scores`` ``[B]`` grouped by ``index`` ``[B]``.

    Returns ``(mean [B], std [B], count [B])`` gathered back to samples, with the *unbiased* std
    (``torch.std``'s default, as verl's code) and, for a group of one, mean ``singleton_mean`` and std
    ``singleton_std`` (verl: 0 and 1). Two-pass (mean, then squared deviations) for accuracy.
    """
    if index is None or len(index) != scores.shape[0]:
        raise ValueError(f"`index` (prompt uid per sample) must have length {scores.shape[0]}")
    gid, g = group_ids(index, scores.device)
    count = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, gid, scores)
    mean_g = total / count
    dev = scores - mean_g[gid]
    ss = torch.zeros_like(total).index_add_(0, gid, dev * dev)
    std_g = torch.sqrt(ss / (count - 1).clamp(min=1))
    single = count == 1
    mean_g = torch.where(single, torch.full_like(mean_g, singleton_mean), mean_g)
    std_g = torch.where(single, torch.full_like(std_g, singleton_std), std_g)
    return mean_g[gid], std_g[gid], count[gid]


@register_adv_est("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, *, index=None, values=None,
                                   reward_baselines=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                                   epsilon=1e-6):
    """GRPO outcome advantage (Shao et al. 2024, arXiv 2402.03300; verl).

    ``s_i = sum_t r_it`` ``[B]``; within each uid group: ``A_i = (s_i - mean) / (std + eps)`` with
    the unbiased std (``norm_adv_by_std_in_grpo=True``), or ``A_i = s_i - mean`` (Dr.GRPO,
    arXiv 2503.20783, ``False``). A group of one has mean 0 and std 1. Broadcast over the response:
    ``A_it = A_i m_it``; returns = advantages. A widely copied worked example uses the population std
    (0.471); verl's code uses ``torch.std`` (unbiased, 0.577), which we follow:
    rewards [1,0,1] -> [0.5774, -1.1547, 0.5774]. Equal rewards give 0 (not NaN).
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, std, _ = group_mean_std(scores, _require(index, "index", "grpo"))
    adv = (scores - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores - mean
    adv = _row_times_mask(adv, response_mask)
    return adv, adv


@register_adv_est("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, *, index=None, values=None,
                                   reward_baselines=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                                   epsilon=1e-6):
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): leave-one-out baseline within the uid group.

    ``A_i = s_i - (sum_{j != i} s_j) / (n - 1) = n / (n - 1) * (s_i - mean)`` for group size
    ``n > 1``; a group of one keeps ``A_i = s_i`` (as verl). ``A_it = A_i m_it``; returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, n = group_mean_std(scores, _require(index, "index", "rloo"))
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), scores)
    adv = _row_times_mask(adv, response_mask)
    return adv, adv


@register_adv_est("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, *, index=None,
                                                           values=None, reward_baselines=None, gamma=1.0, lam=1.0,
                                                           norm_adv_by_std_in_grpo=True, epsilon=1e-6):
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262): ``s_i - group mean`` (0 for a group of
    one), broadcast to ``[B, T]`` and whitened over all valid tokens of the batch; returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _ = group_mean_std(scores, _require(index, "index", "reinforce_plus_plus_baseline"))
    # Whitening statistics from [B] vectors: row i holds a_i on its n_i valid tokens (n_i < 2^24 is
    # exact in the float32 sum, and no float64 copy of the [B, T] mask is made).
    a = (scores - mean).to(torch.float64)
    n = response_mask.sum(-1, dtype=scores.dtype).to(torch.float64)
    mu, rstd = moments_to_mean_rstd(n.sum(), (a * n).sum(), (a * a * n).sum())
    adv = _row_times_mask(((a - mu) * rstd).to(scores.dtype), response_mask)
    return adv, adv


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` over valid tokens ``[B, T]`` (masked tokens are skipped and
    contribute no reward; output 0 there). Equals verl's reset-after-EOS loop for prefix masks.
    """
    return discounted_scan(token_level_rewards, response_mask, gamma, with_moments=False)[0]


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, *, index=None, values=None,
                                                  reward_baselines=None, gamma=1.0, lam=1.0,
                                                  norm_adv_by_std_in_grpo=True, epsilon=1e-6):
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted returns ``G_t`` (see
    :func:`discounted_returns`), advantages = ``masked_whiten(G) * m`` over the batch; returns ``G``.
    """
    returns, moments = discounted_scan(token_level_rewards, response_mask, gamma)
    return whiten_with_moments(returns, response_mask, moments), returns


@register_adv_est("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards, response_mask, *, index=None, values=None,
                                    reward_baselines=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                                    epsilon=1e-6):
    """ReMax (Li et al. 2023, arXiv 2310.10505): ``G_t = sum_{k>=t} r_k m_k`` (undiscounted, as
    verl), ``A_t = G_t - b m_t`` with ``b = reward_baselines`` ``[B]`` the reward of the greedy sample.
    """
    b = _require(reward_baselines, "reward_baselines", "remax")
    returns = discounted_returns(token_level_rewards, response_mask, 1.0)
    mask = response_mask.to(returns.dtype)
    adv = empty_output(tuple(returns.shape), returns)
    return torch.addcmul(returns, b.to(returns.dtype).unsqueeze(-1), mask, value=-1.0, out=adv), returns


@register_adv_est("gae")
@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards, response_mask, *, index=None, values=None,
                                 reward_baselines=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                                 epsilon=1e-6):
    """GAE (Schulman et al. 2016, arXiv 1506.02438; verl's ray_trainer step; docs/driver.md), masked like verl.

    Backwards over t, skipping tokens with ``m_t = 0`` (padding, observation tokens): with ``V'``
    the value of the next *valid* token (0 after the last),
    ``delta_t = r_t + gamma V' - V_t``, ``A_t = delta_t + gamma lam A'``; at masked tokens ``A``
    and ``V'`` carry over unchanged. ``returns = A + V`` (raw A), then advantages are whitened over
    all valid tokens (unbiased variance). Inputs/outputs ``[B, T]``; outputs 0 outside the mask.
    """
    v = _require(values, "values", "gae")
    adv, returns, moments = gae_scan(token_level_rewards, v.to(token_level_rewards.dtype), response_mask, gamma, lam)
    return whiten_with_moments(adv, response_mask, moments, out=adv), returns


@register_adv_est("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, *, index=None, values=None,
                                         reward_baselines=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                                         epsilon=1e-6):
    """Pass@k GRPO (Chen et al. 2025, "Pass@k training", arXiv 2503.19595; verl ``grpo_passk``).

    Within each uid group only the best sample gets a non-zero advantage: ``A = s_max - s_second``,
    divided by ``std_g + eps`` (unbiased group std) when ``norm_adv_by_std_in_grpo``; every other
    sample 0. Ties at the top give 0 whichever sample is "best", so the tie-break cannot matter.
    Groups need at least 2 samples (error otherwise, as verl). ``A_it = A_i m_it``; returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    idx = _require(index, "index", "grpo_passk")
    gid, g = group_ids(idx, scores.device)
    count = torch.bincount(gid, minlength=g)
    if bool((count < 2).any()):
        raise ValueError("advantage estimator 'grpo_passk' needs at least 2 samples per uid group "
                         f"(rollout.n >= 2); smallest group has {int(count.min())}")
    _, std, _ = group_mean_std(scores, idx)
    by_score = torch.argsort(scores, descending=True, stable=True)
    order = by_score[torch.argsort(gid[by_score], stable=True)]  # groups in id order, best first
    starts = torch.cumsum(count, 0) - count
    best, second = order[starts], order[starts + 1]
    top = scores[best] - scores[second]
    if norm_adv_by_std_in_grpo:
        top = top / (std[best] + epsilon)
    adv = torch.zeros_like(scores).index_put_((best,), top)
    adv = _row_times_mask(adv, response_mask)
    return adv, adv


@register_adv_est("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards, response_mask, *, index=None, values=None,
                                  reward_baselines=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                                  epsilon=1e-6):
    """OPO: on-policy RL with the optimal baseline (Hao et al. 2025, arXiv 2505.23585; verl ``opo``).

    Length-weighted group baseline ``b_g = sum_j n_j s_j / sum_j n_j`` (``n_j`` = response tokens),
    ``A_i = s_i - b_g``; a group of one has ``b = 0``. No std normalisation. A group whose responses
    are all empty gets ``b = 0`` (verl divides 0 by 0). ``A_it = A_i m_it``; returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid, g = group_ids(_require(index, "index", "opo"), scores.device)
    n = response_mask.sum(-1).to(scores.dtype)
    count = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, gid, torch.ones_like(scores))
    wsum = torch.zeros_like(count).index_add_(0, gid, n * scores)
    nsum = torch.zeros_like(count).index_add_(0, gid, n)
    base = torch.where((count > 1) & (nsum > 0), wsum / nsum.clamp(min=torch.finfo(scores.dtype).tiny),
                       torch.zeros_like(wsum))
    adv = _row_times_mask(scores - base[gid], response_mask)
    return adv, adv


@register_adv_est("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards, response_mask, *, index=None, values=None,
                                  reward_baselines=None, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
                                  epsilon=1e-6):
    """GPG advantage (Chu et al. 2025, arXiv 2504.02546; verl ``gpg``): ``A_i = alpha (s_i - mean_g)``
    with ``alpha = B / max(1, #{i : s_i != 0})`` over the whole batch (GPG's correction for groups
    without signal) and the group mean (0 for a group of one); no std (verl's ``f_norm`` = 1).
    ``A_it = A_i m_it``; returns = advantages. Pair with the ``gpg`` policy loss.
    """
    scores = token_level_rewards.sum(dim=-1)
    mean, _, _ = group_mean_std(scores, _require(index, "index", "gpg"))
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    adv = _row_times_mask(alpha * (scores - mean), response_mask)
    return adv, adv
