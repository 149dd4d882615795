"""Ray cluster plumbing: ``init_ray`` and a ``WorkerGroup`` of one Ray actor per trainer rank."""
from mrl.cluster.worker_group import WorkerGroup, WorkerGroupError, init_ray

__all__ = ["WorkerGroup", "WorkerGroupError", "init_ray"]
