"""Resumable prompt sampler: the step's prompt indices follow from (seed, epoch, position) alone.

Epoch e visits ``perm_e = randperm(N, generator=seed + e)`` (identity when not shuffling) in
consecutive batches of ``batch_size`` prompts; a tail shorter than a batch is skipped (drop_last,
as verl's train dataloader). ``state_dict()`` after step k and ``load_state_dict`` in a new
process continue with exactly the batch k+1 of an uninterrupted run.
"""
from __future__ import annotations

from typing import Any

import torch


class ResumableSampler:
    """Batches of prompt indices over ``num_items`` prompts, reshuffled deterministically per epoch."""

    def __init__(self, num_items: int, batch_size: int, *, shuffle: bool = True, seed: int = 1) -> None:
        if batch_size > num_items:
            raise ValueError(
                f"data.train_batch_size={batch_size} prompts exceeds the {num_items} prompts of the dataset; "
                "fix: lower data.train_batch_size or add prompts"
            )
        self.num_items, self.batch_size, self.shuffle, self.seed = num_items, batch_size, shuffle, seed
        self.epoch = 0
        self.position = 0  # prompts of the current epoch already handed out
        self._perm = self._permutation(0)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_items // self.batch_size

    def _permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_items)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_items, generator=g)

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` indices; rolls into the next epoch when this one is exhausted."""
        if self.position + self.batch_size > self.num_items:
            self.epoch += 1
            self.position = 0
            self._perm = self._permutation(self.epoch)
        out = self._perm[self.position:self.position + self.batch_size].tolist()
        self.position += self.batch_size
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": self.num_items,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; the dataset size, batch size, seed and shuffle must match the checkpoint's."""
        for key, cfg_key in (("num_items", "the training prompt count"), ("batch_size", "data.train_batch_size"),
                             ("seed", "data.seed"), ("shuffle", "data.shuffle")):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler checkpoint has {key}={state[key]!r} but this run has {getattr(self, key)!r} ({cfg_key}); "
                    "fix: resume with the same data settings, or start fresh (trainer.resume_mode=disable)"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._perm = self._permutation(self.epoch)
