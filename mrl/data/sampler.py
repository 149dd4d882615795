"""Resumable prompt sampler: the step's prompt indices follow from (seed, epoch, position) alone.

Epoch e visits ``perm_e = randperm(N, generator=seed + e)`` (identity when not shuffling) in
consecutive batches of ``batch_size`` prompts; a tail shorter than a batch is skipped (drop_last,
as verl's train dataloader). ``state_dict()`` after step k and ``load_state_dict`` in a new
process continue with exactly the batch k+1 of an uninterrupted run.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mrl.plugins import FORMS, closest, is_spec, load_callable

# data.sampler.class_path: name -> sampler class. A sampler is built as
# cls(num_items, batch_size, *, shuffle, seed, dataset) and provides next_batch() -> list[int],
# batches_per_epoch, state_dict() (JSON-serialisable) and load_state_dict(state) (docs/plugins.md).
_SAMPLERS: dict[str, type] = {}
SAMPLER_METHODS = ("next_batch", "state_dict", "load_state_dict", "batches_per_epoch")


def register_sampler(name: str) -> Callable[[type], type]:
    """Class decorator ``@register_sampler("name")``; a different class under a taken name is an error."""
    def deco(cls: type) -> type:
        old = _SAMPLERS.get(name)
        if old is not None and old is not cls:
            raise ValueError(f"sampler {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        _SAMPLERS[name] = cls
        return cls

    return deco


def get_sampler_cls(spec: str) -> type:
    """The sampler class ``data.sampler.class_path`` names: a registry name or a plugin spec."""
    if is_spec(spec):
        cls = load_callable(spec, "data.sampler.class_path", registered=_SAMPLERS)
    elif spec in _SAMPLERS:
        cls = _SAMPLERS[spec]
    else:
        raise ValueError(f"unknown sampler {spec!r} (config key `data.sampler.class_path`); "
                         f"{closest(spec, _SAMPLERS)}; or a plugin: {FORMS}")
    missing = [m for m in SAMPLER_METHODS if not hasattr(cls, m)]
    if missing:
        raise ValueError(f"data.sampler.class_path={spec!r}: {getattr(cls, '__qualname__', cls)} lacks "
                         f"{', '.join(missing)}; fix: implement the sampler interface (docs/plugins.md)")
    return cls


def sampler_for(data: Any, batch_size: int, dataset: Any) -> Any:
    """The run's sampler: ``data.sampler.class_path`` over ``dataset`` (its rows), ``batch_size`` prompts per
    generation round (RunPlan.gen_batch_size), ordered by ``data.shuffle`` / ``data.seed`` (not trainer.seed)."""
    return get_sampler_cls(data.sampler.class_path)(len(dataset), batch_size, shuffle=data.shuffle, seed=data.seed,
                                                    dataset=dataset)


@register_sampler("resumable")
class ResumableSampler:
    """Batches of prompt indices over ``num_items`` prompts, reshuffled deterministically per epoch."""

    def __init__(self, num_items: int, batch_size: int, *, shuffle: bool = True, seed: int = 1,
                 dataset: Any = None) -> None:  # dataset: the order depends on indices only
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
