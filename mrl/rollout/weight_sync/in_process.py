"""``rollout.weight_sync.transport=inprocess``: each trainer rank copies its weights into the engine it
hosts (:class:`mrl.rollout.engine.in_process.InProcessEngine`). No HTTP, no barrier: at TP = PP = 1
every DP replica holds the whole model, and rank r's engine is engine r of the pool."""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from mrl.rollout.engine.in_process import InProcessEngine
from mrl.rollout.weight_sync.sender import WeightSyncReport


class InProcessSyncer:
    """The ``WeightSyncer`` interface the trainer rank uses (``init``/``sync``/``rejoin``/``close``)."""

    def __init__(self, engine: InProcessEngine, *, verify: bool, timeout_s: float = 300.0) -> None:
        self.engine, self.verify, self.timeout_s = engine, verify, timeout_s

    def init(self) -> None:
        pass  # nothing to connect: the engine is an object of this process

    def rejoin(self) -> None:
        pass  # an in-process engine cannot restart on its own (it dies with its rank)

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str, *,
             pause: bool = True) -> WeightSyncReport:
        """Load one full set of weights. ``pause`` is moot: the copy waits until the engine is idle and
        runs between two scheduler steps under the model lock, so nothing generates on half-new weights."""
        t0 = time.perf_counter()
        nbytes, ntensors = self.engine.load_weights(named_tensors, str(version), verify=self.verify,
                                                    timeout_s=self.timeout_s)
        return WeightSyncReport(str(version), "inprocess", time.perf_counter() - t0, nbytes, ntensors, 1, self.verify)

    def close(self) -> None:
        pass  # the rank stops its engine (TrainRank.close)
