"""Step-level rollout correction (verl's ``compute_rollout_correction_and_add_to_batch``): right after
π_old is recomputed, the whole step batch gets its IS weights (``rollout_is_weights``, used by the actor
loss) and the rejection mask folded into ``response_mask``, before advantages, as verl's trainer does.
The math is :mod:`mrl.algorithms.rollout_correction`; the configuration ``algorithm.rollout_correction``."""
from __future__ import annotations

from mrl.algorithms.rollout_correction import compute_rollout_correction
from mrl.config.algorithm import RolloutCorrectionConfig
from mrl.workers.batch import TrainBatch


def apply_rollout_correction(batch: TrainBatch, cfg: RolloutCorrectionConfig) -> tuple[TrainBatch, dict[str, float]]:
    """``(batch with rollout_is_weights and the rejection-masked response_mask, rollout_corr/* metrics)``."""
    if batch.rollout_log_probs is None or batch.old_log_probs is None:
        raise RuntimeError("algorithm.rollout_correction is on but the step batch has no rollout_log_probs (the "
                           "engines' log-probs) or no old_log_probs; fix: use an engine that returns log-probs, or "
                           "set algorithm.rollout_correction.rollout_is and rollout_rs to null")
    out = compute_rollout_correction(
        batch.old_log_probs.float(), batch.rollout_log_probs.float(), batch.response_mask,
        rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_is_batch_normalize=cfg.rollout_is_batch_normalize, rollout_rs=cfg.rollout_rs,
        rollout_rs_threshold=cfg.rollout_rs_threshold)
    return batch.replace(response_mask=out.response_mask, rollout_is_weights=out.weights), out.metrics
