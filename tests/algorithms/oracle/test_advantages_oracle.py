"""Every advantage estimator mrl shares with verl, against verl 0.9's own code on random rewards
with masks (prefix masks, an empty row, groups of 4): advantages and returns, fp32, atol 2e-6."""
from __future__ import annotations

import pytest
import torch

from mrl.algorithms import get_adv_estimator
from tests.algorithms.oracle.inputs import B, T, index, prefix_mask, randn

TOL = 2e-6
GAMMA, LAM = 0.97, 0.9


def _outcome(seed, mask):
    """Outcome rewards on the last valid token, a few exact zeros (GPG counts non-zero scores)."""
    s = randn(seed, B).round(decimals=1)
    s[::5] = 0.0
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    r = torch.zeros(B, T)
    r[torch.arange(B), last] = s * (mask.sum(-1) > 0)
    return r


def _algo_config(verl, **kw):
    from verl.trainer.config import AlgoConfig

    return AlgoConfig(**kw)


# name, verl call (core, rewards, mask, values, baselines, cfg) -> (adv, ret), mrl kwargs, token-level rewards
CASES = {
    "grpo": (lambda c, r, m, v, b, cfg: c.compute_grpo_outcome_advantage(r, m, index(), norm_adv_by_std_in_grpo=True),
             {}, False),
    "grpo-no-std": (lambda c, r, m, v, b, cfg: c.compute_grpo_outcome_advantage(r, m, index(),
                                                                                  norm_adv_by_std_in_grpo=False),
                    {"norm_adv_by_std_in_grpo": False}, False),
    "rloo": (lambda c, r, m, v, b, cfg: c.compute_rloo_outcome_advantage(r, m, index(), config=cfg), {}, False),
    "reinforce_plus_plus_baseline": (
        lambda c, r, m, v, b, cfg: c.compute_reinforce_plus_plus_baseline_outcome_advantage(
            r, m, index(), config=cfg), {}, False),
    "reinforce_plus_plus": (lambda c, r, m, v, b, cfg: c.compute_reinforce_plus_plus_outcome_advantage(r, m, config=cfg),
                            {"gamma": GAMMA}, True),
    "remax": (lambda c, r, m, v, b, cfg: c.compute_remax_outcome_advantage(r, b, m, config=cfg), {}, True),
    "gae": (lambda c, r, m, v, b, cfg: c.compute_gae_advantage_return(r, v, m, GAMMA, LAM), {"gamma": GAMMA, "lam": LAM},
            True),
    "grpo_passk": (lambda c, r, m, v, b, cfg: c.compute_grpo_passk_outcome_advantage(r, m, index(), config=cfg),
                   {}, False),
    "grpo_passk-no-std": (
        lambda c, r, m, v, b, cfg: c.compute_grpo_passk_outcome_advantage(
            r, m, index(), config=_algo_config(None, norm_adv_by_std_in_grpo=False)),
        {"norm_adv_by_std_in_grpo": False}, False),
    "opo": (lambda c, r, m, v, b, cfg: c.compute_opo_outcome_advantage(r, m, index(), config=cfg), {}, False),
    "gpg": (lambda c, r, m, v, b, cfg: c.compute_gpg_outcome_advantage(r, m, index(), config=cfg), {}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimator_matches_verl(verl, case):
    core, _ = verl
    call, kw, token_level = CASES[case]
    name = case.removesuffix("-no-std")
    mask = prefix_mask(31)
    rewards = randn(32, B, T) * mask if token_level else _outcome(32, mask)
    values = randn(33, B, T) * mask
    baselines = randn(34, B)
    cfg = _algo_config(verl, gamma=GAMMA, lam=LAM)
    v_adv, v_ret = call(core, rewards.clone(), mask, values, baselines, cfg)
    adv, ret = get_adv_estimator(name)(rewards.clone(), mask, index=index(), values=values,
                                       reward_baselines=baselines, **kw)
    assert v_adv.abs().max() > 1e-2  # not a degenerate case
    # verl's GAE leaves carried-over values outside the mask; mrl writes 0 there (its contract):
    # compare on valid tokens, and check mrl's zeros.
    v_adv, v_ret = v_adv * mask, v_ret * mask
    assert not adv[mask == 0].any() and not ret[mask == 0].any()
    torch.testing.assert_close(adv, v_adv.to(adv.dtype), atol=TOL, rtol=TOL)
    torch.testing.assert_close(ret, v_ret.to(ret.dtype), atol=TOL, rtol=TOL)


def test_passk_refuses_groups_of_one_like_verl(verl):
    mask = prefix_mask(31)
    with pytest.raises(ValueError, match="at least 2 samples"):
        get_adv_estimator("grpo_passk")(_outcome(1, mask), mask, index=list(range(B)))
