"""Actor -> engine weight sync (sender side); see docs/weight_sync.md."""
from mrl.rollout.weight_sync.buckets import Bucket, iter_buckets, unflatten
from mrl.rollout.weight_sync.sender import (
    TRANSPORTS,
    WeightSyncer,
    WeightSyncReport,
    WeightVerifyError,
    disk_resync,
)

__all__ = [
    "TRANSPORTS",
    "Bucket",
    "WeightSyncReport",
    "WeightSyncer",
    "WeightVerifyError",
    "disk_resync",
    "iter_buckets",
    "unflatten",
]
