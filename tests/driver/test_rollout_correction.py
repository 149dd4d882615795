"""The trainer's rollout-correction phase on a step batch: weights and rejection folded into the
batch the actor receives (and carried by its mini-batch selection), errors naming the key."""
from __future__ import annotations

import math

import pytest
import torch

from mrl.config.algorithm import RolloutCorrectionConfig
from mrl.driver.rollout_correction import apply_rollout_correction
from mrl.workers.minibatch import loss_keys, make_minibatch_iterator
from tests.workers.batches import ragged_batch


def test_weights_and_rejection_are_folded_into_the_batch():
    b = ragged_batch(with_rollout=True)
    b = b.replace(rollout_log_probs=(b.old_log_probs - 0.3 * torch.randn(b.old_log_probs.shape,
                                                                          generator=torch.Generator().manual_seed(1)))
                  * b.response_mask)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1",
                                  rollout_rs_threshold="0.7_1.4")
    out, m = apply_rollout_correction(b, cfg)
    rho = torch.exp(b.old_log_probs - b.rollout_log_probs)
    torch.testing.assert_close(out.rollout_is_weights, rho.clamp(max=1.5) * b.response_mask)
    keep = (rho >= 0.7) & (rho <= 1.4)
    assert torch.equal(out.response_mask, b.response_mask * keep)
    assert 0 < out.response_mask.sum() < b.response_mask.sum()
    assert out.response_mask.dtype == b.response_mask.dtype
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        float(((~keep) & (b.response_mask > 0)).sum() / b.response_mask.sum()))
    assert all(k.startswith("rollout_corr/") and math.isfinite(v) for k, v in m.items())
    # the actor's mini-batches carry the weights when they are present
    keys = loss_keys(use_kl_loss=False, use_rollout_log_probs=False, use_rollout_is_weights=True)
    mb = next(make_minibatch_iterator(out, mini_batch_size=out.batch_size, select_keys=keys))
    assert torch.equal(mb.rollout_is_weights, out.rollout_is_weights)


def test_rejection_only_leaves_no_weights():
    b = ragged_batch(with_rollout=True)
    out, m = apply_rollout_correction(b, RolloutCorrectionConfig(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.5))
    assert out.rollout_is_weights is None and "rollout_corr/rollout_is_mean" not in m
    assert "rollout_corr/rollout_rs_seq_mean_k3_masked_fraction" in m


def test_missing_engine_log_probs_name_the_key():
    with pytest.raises(RuntimeError, match="algorithm.rollout_correction"):
        apply_rollout_correction(ragged_batch(), RolloutCorrectionConfig(rollout_is="token"))
