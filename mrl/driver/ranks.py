"""Typed calls from the driver to every trainer rank.

``ranks.update_policy(batch)`` runs ``TrainRank.update_policy(batch)`` (mrl/workers/rank.py) on every
rank of the group — each rank gets the same full batch and, for the model phases, returns the same
result — and gives back rank 0's answer; ``sync_weights`` returns every rank's (one sender per
pipeline stage). Method names and parameters mirror ``TrainRank`` (tests/driver/test_ranks.py
compares the signatures), so the driver reads as typed calls and a rename breaks a test, not a run.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from mrl.workers.batch import TrainBatch


class RankGroup(Protocol):
    """What the proxy needs of ``mrl.cluster.WorkerGroup``."""

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]: ...


class TrainRanks:
    def __init__(self, group: RankGroup) -> None:
        self.group = group

    def _first(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.group.execute_all(method, *args, **kwargs)[0]

    # ---- engines inside the ranks (rollout.weight_sync.transport=inprocess) ---------------------
    def start_engine(self, urls: list[str], token: str | None) -> None:
        self.group.execute_all("start_engine", urls, token)

    # ---- weight sync ---------------------------------------------------------------------------
    def init_weight_sync(self, engine_urls: list[str], token: str | None = None, routable: bool = False) -> None:
        self.group.execute_all("init_weight_sync", engine_urls, token=token, routable=routable)

    def rejoin_weight_sync(self) -> None:
        self.group.execute_all("rejoin_weight_sync")

    def sync_weights(self, version: int, pause: bool = True) -> list[dict[str, float]]:
        """Every rank's report (``{}`` on ranks that send nothing); ``pause``: see WeightSyncer.sync."""
        return [r or {} for r in self.group.execute_all("sync_weights", version, pause=pause)]

    # ---- forward phases ------------------------------------------------------------------------
    def compute_log_prob(self, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self._first("compute_log_prob", batch)

    def compute_ref_log_prob(self, batch: TrainBatch) -> torch.Tensor:
        return self._first("compute_ref_log_prob", batch)

    def compute_repr_similarity(self, batch: TrainBatch, gold: TrainBatch) -> torch.Tensor:
        return self._first("compute_repr_similarity", batch, gold)

    def compute_side(self, role: str, batch: TrainBatch) -> torch.Tensor:
        return self._first("compute_side", role, batch)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        return self._first("compute_values", batch)

    # ---- updates -------------------------------------------------------------------------------
    def update_policy(self, batch: TrainBatch) -> dict[str, float]:
        return self._first("update_policy", batch)

    def update_policy_on_policy(self, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        return self._first("update_policy_on_policy", batch)

    def update_policy_on_policy_and_sync(self, batch: TrainBatch, version: int
                                         ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor, list[dict[str, float]]]:
        """Rank 0's update results and every rank's sync report (as ``sync_weights`` gives them)."""
        out = self.group.execute_all("update_policy_on_policy_and_sync", batch, version)
        return out[0][0], out[0][1], out[0][2], [r[3] or {} for r in out]

    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        return self._first("update_critic", batch)

    def fallbacks(self) -> list[list[str]]:
        """Every rank's Megatron/torch fallbacks (printed once by the driver)."""
        return self.group.execute_all("fallbacks")

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self, ckpt_dir: str, contents: list[str]) -> None:
        self.group.execute_all("save", ckpt_dir, contents)

    def load(self, ckpt_dir: str, contents: list[str]) -> None:
        self.group.execute_all("load", ckpt_dir, contents)

    def save_critic(self, ckpt_dir: str) -> None:
        self.group.execute_all("save_critic", ckpt_dir)

    def load_critic(self, ckpt_dir: str) -> None:
        self.group.execute_all("load_critic", ckpt_dir)
