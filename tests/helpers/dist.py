"""Run a function on N gloo ranks in fresh processes, with a timeout and clean-up.

Usage in a test::

    def _body(rank, world_size, tmp_path):      # module-level, picklable
        ...
        return some_picklable_result

    results = run_ranks(_body, world_size=4, args=(tmp_path,), timeout_s=120)

Each rank gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK in its environment and an
initialised default process group (gloo) unless ``init_process_group=False``. Results come back
as a list indexed by rank. A rank that raises makes the whole call raise with its traceback; a
rank that hangs past ``timeout_s`` makes every rank get killed and the call raise TimeoutError.
The processes are mrl's one local-rank launcher (``mrl.local_ranks``), one thread per rank, forked
from a server per test worker that imported torch, Megatron and the modules most ranks use once
(``PRELOAD``): ~30 multi-rank files would otherwise pay ~2 s of imports per rank, two to four ranks per call.
"""
from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any

from mrl.local_ranks import RankError, run_local_ranks
from mrl.net import free_port  # re-exported: the tests import it from here

__all__ = ["free_port", "run_ranks"]

# Imported once by the forkserver (mrl.megatron before megatron.core: its import hook, mrl/megatron/import_hooks.py);
# none starts a thread or touches CUDA on import (checked by tests/test_local_ranks.py), which forking needs.
PRELOAD = ("torch", "torch.distributed", "mrl.megatron", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.pipeline_parallel", "megatron.core.optimizer", "megatron.core.dist_checkpointing", "transformers",
           "mrl.megatron.provider", "mrl.megatron.parallel", "mrl.megatron.checkpoint", "mrl.megatron.hf_io",
           "mrl.workers.actor")


def _body(fn: Callable[..., Any], world_size: int, init_pg: bool, pg_timeout_s: int, rank: int, *args: Any) -> Any:
    if init_pg:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
    return fn(rank, world_size, *args)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 180,
    init_process_group: bool = True,
) -> list[Any]:
    body = functools.partial(_body, fn, world_size, init_process_group, max(30, int(timeout_s)))
    try:  # one thread per rank: several ranks share two cores in CI
        return run_local_ranks(body, world_size, args, timeout_s=timeout_s, threads_per_rank=1, preload=PRELOAD)
    except RankError as e:
        raise RuntimeError(f"a rank failed:\n--- rank {e.rank} ---\n{e.details or e.message}") from None
