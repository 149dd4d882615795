"""Rollout correction (IS weights, rejection masks, ``rollout_corr/*`` metrics) against verl 0.9's
``compute_rollout_correction_and_rejection_mask`` on random log-probs with masks (fp32, 2e-6)."""
from __future__ import annotations

import pytest
import torch

from mrl.algorithms.rollout_correction import compute_rollout_correction
from tests.algorithms.oracle.inputs import B, T, log_probs, prefix_mask, randn

TOL = 2e-6
# (rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold)
CASES = {
    "token-tis": ("token", 1.3, False, None, None),
    "seq-tis": ("sequence", 1.2, False, None, None),
    "token-icepop": ("token", "0.8_1.25", False, None, None),
    "seq-icepop": ("sequence", "0.8_1.2", False, None, None),
    "token-tis-batchnorm": ("token", 1.3, True, None, None),
    "seq-tis-batchnorm": ("sequence", 1.2, True, None, None),
    "token-mis-k1": (None, 2.0, False, "token_k1", "0.85_1.2"),
    "geo-mean-rs": ("token", 1.1, False, "seq_mean_k1", 1.05),
    "k1-single-bound": (None, 2.0, False, "seq_sum_k1", 1.5),
    "multi-rs": ("sequence", 1.2, False, "token_k2,seq_sum_k3", "0.02,0.3"),
    "seq-max": (None, 2.0, False, "seq_max_k3,seq_mean_k2", "0.05"),
    "token-k3": ("token", 1.1, False, "token_k3", 0.01),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rollout_correction_matches_verl(verl, case):
    _, corr = verl
    is_, thr, bn, rs, rs_thr = CASES[case]
    roll, _ = log_probs(41)
    old = roll + 0.15 * randn(42, B, T)
    mask = prefix_mask(43)
    v_w, v_mask, v_m = corr.compute_rollout_correction_and_rejection_mask(
        old, roll, mask, rollout_is=is_, rollout_is_threshold=thr, rollout_is_batch_normalize=bn,
        rollout_rs=rs, rollout_rs_threshold=rs_thr)
    out = compute_rollout_correction(old, roll, mask, rollout_is=is_, rollout_is_threshold=thr,
                                     rollout_is_batch_normalize=bn, rollout_rs=rs, rollout_rs_threshold=rs_thr)
    if is_ is None:
        assert out.weights is None and v_w is None
    else:
        torch.testing.assert_close(out.weights, v_w.batch["rollout_is_weights"], atol=TOL, rtol=TOL)
    assert torch.equal(out.response_mask, v_mask)
    if rs is not None:  # the thresholds were chosen so that something is rejected, not everything
        assert 0 < out.metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    if is_ is not None:
        hi = out.metrics["rollout_corr/rollout_is_ratio_fraction_high"]
        assert hi > 0, "the threshold binds somewhere"
    missing = set(out.metrics) - set(v_m)
    assert not missing, f"metric names verl does not have: {missing}"
    for k, v in out.metrics.items():
        assert v == pytest.approx(v_m[k], rel=TOL, abs=TOL), k
