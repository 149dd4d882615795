"""Cluster section: where the Ray job runs and how many devices it has.

Total devices ``D = nnodes * n_gpus_per_node``; with ``device=cpu`` a "device" is one gloo
process (rank), so ``n_gpus_per_node`` then counts CPU ranks per node.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from mrl.config.base import Section


class ClusterConfig(Section):
    """Ray cluster and device inventory (verl ``trainer.nnodes`` / ``trainer.n_gpus_per_node``)."""

    address: str | None = Field(
        None, description="Ray address to join ('auto' or host:port); null starts a local Ray instance."
    )
    nnodes: int = Field(1, ge=1, description="Nodes in the job.")
    n_gpus_per_node: int = Field(8, ge=1, description="Devices per node (GPUs; with device=cpu, gloo ranks per node).")
    cpus_per_node: int | None = Field(None, ge=1, description="CPUs Ray may use per node; null = all.")
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto: CUDA when the workers see a GPU, else CPU.")

    @property
    def world_size(self) -> int:
        """Total devices (or CPU ranks) of the job."""
        return self.nnodes * self.n_gpus_per_node
