"""Off-policy schedule (``trainer.async_training``); its plan-time checks are config/validate_async.py.

``max_staleness = k > 0`` runs a rollout producer next to the trainer (mrl/driver/async_rollout.py,
docs/async.md): the engines generate the batch of step i once the trainer has finished step i - k,
with the newest weights they hold, while the trainer trains on earlier batches; a sample made by
weight version w is trained at a step whose weights are version v with v - w <= k. 0 is the
synchronous loop (generate, then train, then push), unchanged.
"""
from __future__ import annotations

from pydantic import Field

from mrl.config.base import Section


class AsyncTrainingConfig(Section):
    """Bounded-staleness off-policy training (verl's one-step-off / fully-async ``staleness_threshold``)."""

    max_staleness: int = Field(
        0, ge=0, le=64, description="k: the trainer trains on samples made by weights at most k versions older than its own "
        "(the producer runs up to k batches ahead); older samples are refused (async/stale_dropped). "
        "0 = synchronous loop; 1 = one-step-off; at most 64 (k batches wait in host memory).")
    batch_timeout_s: float = Field(
        900.0, gt=0, description="Seconds the trainer waits for the producer's next batch, and a weight push for the "
        "producer to reach a point where the push is safe, before failing the step.")


