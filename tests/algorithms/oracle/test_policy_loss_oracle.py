"""Every policy loss and loss-aggregation mode mrl shares with verl, against verl 0.9's own code:
loss value, gradient w.r.t. log_prob and the metrics verl reports, on random inputs with masks
(fp32, atol 2e-6), with and without rollout-correction weights."""
from __future__ import annotations

import pytest
import torch

from mrl.algorithms import LOSS_AGG_MODES, agg_loss, get_policy_loss_fn
from mrl.algorithms.policy_loss import PolicyLossParams
from tests.algorithms.oracle.inputs import B, T, log_probs, prefix_mask, randn
from tests.helpers.verl_oracle import actor_config

TOL = 2e-6
C = 16.0  # Dr.GRPO's constant (max_response_length) for seq-mean-token-sum-norm
PARAMS = PolicyLossParams(tau_pos=1.0, tau_neg=1.05, clip_cov_ratio=0.05, clip_cov_lb=0.2, clip_cov_ub=5.0,
                          kl_cov_ratio=0.05, ppo_kl_coef=0.1)
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
DPPO_CLIP = {"clip_ratio_low": 0.05, "clip_ratio_high": 0.08, "clip_ratio_c": 20.0}  # divergence thresholds
ALL_MODES = [m for m in LOSS_AGG_MODES]
# (mrl name == verl name, agg modes to test, clip kwargs, rows must be non-empty)
LOSSES = [
    ("vanilla", ALL_MODES, CLIP, False),
    ("gspo", ALL_MODES, CLIP, False),
    ("cispo", ALL_MODES, CLIP, False),
    ("gpg", ALL_MODES, CLIP, False),
    ("clip_cov", ALL_MODES, CLIP, False),
    ("kl_cov", ALL_MODES, CLIP, False),
    ("dppo_tv", ALL_MODES, DPPO_CLIP, False),
    ("dppo_kl", ALL_MODES, DPPO_CLIP, False),
    ("sapo", ["seq-mean-token-mean"], CLIP, False),  # verl hard-codes this mode for SAPO
    ("geo_mean", ["seq-mean-token-mean"], CLIP, True),  # verl: mean over rows (B), mode unused
]
CASES = [(name, mode, clip, full, w) for name, modes, clip, full in LOSSES for mode in modes for w in (False, True)]


def _inputs(seed: int, full: bool):
    old, new = log_probs(seed)
    adv = randn(seed + 1, B, T)
    mask = prefix_mask(seed + 2, empty_row=not full)
    w = torch.exp(0.2 * randn(seed + 3, B, T)).clamp(max=2.0) * mask  # rollout_is_weights-like
    return old, new, adv, mask, w


def _verl(verl, name, mode, clip, old, new, adv, mask, w):
    core, _ = verl
    cfg = actor_config(loss_mode=name, loss_agg_mode=mode, tau_pos=PARAMS.tau_pos, tau_neg=PARAMS.tau_neg,
                       clip_cov_ratio=PARAMS.clip_cov_ratio, clip_cov_lb=PARAMS.clip_cov_lb,
                       clip_cov_ub=PARAMS.clip_cov_ub, kl_cov_ratio=PARAMS.kl_cov_ratio,
                       ppo_kl_coef=PARAMS.ppo_kl_coef, loss_scale_factor=C, **clip)
    lp = new.clone().requires_grad_(True)
    torch.manual_seed(0)  # clip_cov draws with torch.randperm
    loss, metrics = core.get_policy_loss_fn(name)(old, lp, adv, mask, loss_agg_mode=mode, config=cfg,
                                                  rollout_is_weights=w)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _mrl(name, mode, clip, old, new, adv, mask, w):
    lp = new.clone().requires_grad_(True)
    torch.manual_seed(0)
    out = get_policy_loss_fn(name)(old, lp, adv, mask, loss_agg_mode=mode, norm_constant=C, rollout_is_weights=w,
                                   loss_params=PARAMS, **clip)
    out.pg_loss.backward()
    return out, lp.grad


@pytest.mark.parametrize("name,mode,clip,full,weighted", CASES,
                         ids=[f"{c[0]}-{c[1]}-{'w' if c[4] else 'now'}" for c in CASES])
def test_policy_loss_matches_verl(verl, name, mode, clip, full, weighted):
    old, new, adv, mask, w = _inputs(11, full)
    w = w if weighted else None
    v_loss, v_grad, v_metrics = _verl(verl, name, mode, clip, old, new, adv, mask, w)
    out, grad = _mrl(name, mode, clip, old, new, adv, mask, w)
    assert v_loss.abs() > 1e-3  # the case is not degenerate
    torch.testing.assert_close(out.pg_loss.detach(), v_loss, atol=TOL, rtol=TOL)
    torch.testing.assert_close(grad, v_grad, atol=TOL, rtol=TOL)
    for key, mine in (("actor/pg_clipfrac", out.pg_clipfrac), ("actor/ppo_kl", out.ppo_kl),
                      ("actor/pg_clipfrac_lower", out.pg_clipfrac_lower)):
        if key in v_metrics:
            assert float(mine) == pytest.approx(v_metrics[key], abs=TOL), key


def test_cases_exercise_the_interesting_branches(verl):
    """The random inputs clip (PPO), drop (Clip-Cov, DPPO) and penalise (KL-Cov) some tokens, so the
    comparisons above cover those branches, not just the identity path."""
    old, new, adv, mask, _ = _inputs(11, False)
    frac = {n: float(_mrl(n, "token-mean", c, old, new, adv, mask, None)[0].pg_clipfrac)
            for n, c in (("vanilla", CLIP), ("cispo", CLIP), ("clip_cov", CLIP), ("kl_cov", CLIP),
                         ("dppo_tv", DPPO_CLIP), ("dppo_kl", DPPO_CLIP))}
    assert all(0 < f < 1 for f in frac.values()), frac


@pytest.mark.parametrize("mode", ALL_MODES)
def test_agg_loss_matches_verl(verl, mode):
    core, _ = verl
    loss_mat, mask = randn(5, B, T), prefix_mask(6)
    ref = core.agg_loss(loss_mat, mask, mode, loss_scale_factor=C)
    torch.testing.assert_close(agg_loss(loss_mat, mask, mode, norm_constant=C), ref, atol=TOL, rtol=TOL)


def test_tis_cap_equals_verl_token_rollout_is(verl):
    """mrl's ``actor.tis_imp_ratio_cap`` is verl's token-level TIS (rollout_is=token, threshold=cap)."""
    _, corr = verl
    old, new, adv, mask, _ = _inputs(21, False)
    roll = old + 0.3 * randn(22, B, T)
    w, _ = corr.compute_rollout_correction_weights(old - roll, mask, rollout_is="token", rollout_is_threshold=1.5)
    v_loss, v_grad, _ = _verl(verl, "vanilla", "token-mean", CLIP, old, new, adv, mask, w)
    lp = new.clone().requires_grad_(True)
    out = get_policy_loss_fn("vanilla")(old, lp, adv, mask, loss_agg_mode="token-mean", rollout_log_probs=roll,
                                        tis_imp_ratio_cap=1.5, **CLIP)
    out.pg_loss.backward()
    torch.testing.assert_close(out.pg_loss.detach(), v_loss, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lp.grad, v_grad, atol=TOL, rtol=TOL)
