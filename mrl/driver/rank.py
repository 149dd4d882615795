"""What one trainer rank holds in the driver: the actor, its colocated reference, the weight sender.

Constructed inside a Ray rank actor (``mrl.cluster.WorkerGroup``) after RANK/WORLD_SIZE/... are
set; every method is called on all ranks with the same full batch and returns identical results.
"""
from __future__ import annotations

import os

import torch

from mrl.config import MRLConfig
from mrl.workers.actor import ActorWorker
from mrl.workers.batch import TrainBatch
from mrl.workers.reference import ColocatedReference


class TrainRank:
    """Actor + reference (+ weight sync) of this rank; see the driver for the call order."""

    def __init__(self, cfg: MRLConfig, *, total_optimizer_steps: int | None) -> None:
        torch.set_num_threads(int(os.environ.get("MRL_TORCH_THREADS", "1")))
        self.cfg = cfg
        self.actor = ActorWorker(
            cfg.actor, model_path=cfg.model.path, device=cfg.cluster.device if cfg.cluster.device != "auto" else
            ("cuda" if torch.cuda.is_available() else "cpu"),
            mini_batch_size_samples=cfg.actor.ppo_mini_batch_size * cfg.rollout.n,
            temperature=cfg.rollout.temperature, max_response_length=cfg.rollout.max_response_length,
            total_optimizer_steps=total_optimizer_steps,
            seed=cfg.trainer.seed,
        )
        # Snapshot of the start weights, before any update (verl's ref = initial policy).
        self.ref = ColocatedReference(self.actor) if cfg.ref_enabled else None
        self.syncer = None

    def init_weight_sync(self, engine_urls: list[str]) -> None:
        """Build the sender: the first DP replica's TP-rank 0 of each PP stage sends; rank 0 steers."""
        from megatron.core import parallel_state as ps

        from mrl.rollout.weight_sync import WeightSyncer

        ws = self.cfg.rollout.weight_sync
        self.syncer = WeightSyncer(
            ws.transport, engine_urls, bucket_mb=ws.bucket_mb, verify=ws.verify,
            stage=ps.get_pipeline_model_parallel_rank(),
            is_source=ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0,
            is_coordinator=torch.distributed.get_rank() == 0,
            engine_world_sizes=[self.cfg.rollout.engine_tp_size] * len(engine_urls),
            disk_dir=ws.disk_dir, snapshot_dir=ws.snapshot_dir,
        )
        self.syncer.init()

    def compute_log_prob(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor.compute_log_prob(batch)

    def compute_ref_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob called but no reference model was built (ref_enabled is false)")
        return self.ref.compute_ref_log_prob(batch)

    def update_policy(self, batch: TrainBatch) -> dict[str, float]:
        return self.actor.update_policy(batch)

    def sync_weights(self, version: int) -> dict[str, float]:
        if self.syncer is None:
            raise RuntimeError("sync_weights before init_weight_sync")
        return self.syncer.sync(self.actor.export_hf_weights(), version).metrics()

    def save(self, ckpt_dir: str) -> None:
        self.actor.save(ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self.actor.load(ckpt_dir)

    def close(self) -> None:
        if self.syncer is not None:
            self.syncer.close()
