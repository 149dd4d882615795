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
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from mrl.net import free_port  # re-exported: the tests import it from here


def _entry(fn, rank, world_size, port, args, init_pg, pg_timeout_s, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        # One thread per rank: several ranks share two cores in CI.
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        if init_pg:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        out = fn(rank, world_size, *args)
        # Plain pickle serialises tensors by value. The queue's own pickler would send them as
        # shared-memory handles, which die with this process before the parent reads them (hang).
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "err", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - best-effort teardown; the result is already sent
            print(f"rank {rank}: destroy_process_group failed: {e}", flush=True)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout_s: float = 180,
    init_process_group: bool = True,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, tuple(args), init_process_group, max(30, int(timeout_s)), queue),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) + len(errors) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                raise TimeoutError(
                    f"{len(results)}/{world_size} ranks finished within {timeout_s}s; "
                    f"errors so far: {errors}"
                )
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except Exception:  # noqa: BLE001 - queue.Empty or a broken pipe from a dead rank
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    # A rank died without reporting (segfault, OOM kill).
                    raise RuntimeError(
                        f"rank process(es) died without a report: exit codes "
                        f"{[p.exitcode for p in procs]}; errors: {errors}"
                    )
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)  # our own child's result, not external input
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                # One failed rank usually leaves the others blocked in a collective: stop early.
                break
        if errors:
            raise RuntimeError("a rank failed:\n" + "\n".join(errors))
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
