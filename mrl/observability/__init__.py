"""Metric names, data metrics, timers and console/MLflow tracking (no Ray/Megatron imports)."""
from mrl.observability import names
from mrl.observability.data_metrics import (
    compute_data_metrics,
    compute_rollout_mismatch_metrics,
    compute_throughput_metrics,
)
from mrl.observability.timer import timer
from mrl.observability.tracking import ConsoleSink, MlflowSink, Tracking, flatten

__all__ = [
    "ConsoleSink", "MlflowSink", "Tracking", "compute_data_metrics", "compute_rollout_mismatch_metrics",
    "compute_throughput_metrics", "flatten", "names",
    "timer",
]
