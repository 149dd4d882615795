"""``with timer("gen", metrics):`` adds the block's wall time to ``metrics["timing_s/gen"]`` (seconds).

Repeated blocks of one phase in a step add up (e.g. two generation rounds); the driver starts each
step with a fresh dict. verl's ``_timer`` / ``marked_timer`` give the same names.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager

from mrl.observability.names import timing


@contextmanager
def timer(name: str, metrics: MutableMapping[str, float]) -> Iterator[None]:
    """Time the block with ``time.perf_counter``; recorded even when the block raises."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        key = timing(name)
        metrics[key] = metrics.get(key, 0.0) + (time.perf_counter() - t0)
