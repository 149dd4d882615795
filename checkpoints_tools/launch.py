"""Run one conversion function on N local ranks (gloo on CPU, NCCL on GPUs) with a deadline.

``mrl-ckpt`` starts its own ranks so that a user runs one command. Each rank is a fresh
``spawn`` process (Megatron's ``parallel_state`` and CUDA cannot be forked safely) in its own
process group, so that the writer processes ``dist_checkpointing.save`` forks are cleaned up with
it. The first failing rank stops the job: every rank is killed and its message is re-raised in
the parent as :class:`RankError` (one message, not N interleaved tracebacks).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from mrl.net import free_port


class RankError(RuntimeError):
    """A rank raised; ``message`` is its error line, ``details`` its full traceback."""

    def __init__(self, rank: int, message: str, details: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank, self.message, self.details = rank, message, details


def pick_device(requested: str, world_size: int) -> str:
    """``auto`` → ``cuda`` when at least ``world_size`` GPUs are visible, else ``cpu``."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus < world_size:
        raise ValueError(
            f"--device cuda needs {world_size} GPUs (tp*pp) but {gpus} are visible; "
            "use --device cpu or fewer ranks"
        )
    return "cuda" if gpus >= world_size else "cpu"


def _set_rank_env(rank: int, world_size: int, port: int, device: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if device == "cpu":
        # Ranks share the host's cores; oversubscribing them slows every collective down.
        threads = max(1, (os.cpu_count() or 1) // world_size)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


def _entry(fn: Callable, rank: int, world_size: int, port: int, device: str, args: tuple, queue: Any) -> None:
    os.setpgrp()  # own process group: the parent can kill this rank and its writer children
    _set_rank_env(rank, world_size, port, device)
    try:
        queue.put((rank, "ok", fn(rank, *args)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "err", (f"{type(e).__name__}: {e}", traceback.format_exc())))
    finally:
        from mrl.megatron.parallel import destroy_parallel

        with contextlib.suppress(Exception):  # best effort on the way out
            destroy_parallel()


def _kill(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        p.join(timeout=5)


def run_local_ranks(
    fn: Callable[..., Any], world_size: int, args: Sequence[Any], *, device: str, timeout_s: float
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks; results by rank, or :class:`RankError`."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, device, tuple(args), queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(results)}/{world_size} ranks finished within --timeout {timeout_s:.0f}s; "
                    "raise --timeout for large models"
                )
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except queue_mod.Empty:  # check for ranks that died without a word
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    raise RankError(
                        dead[0], f"process died with exit code {procs[dead[0]].exitcode} "
                        "(killed for memory? try fewer ranks or a smaller --dtype)", "",
                    ) from None
                continue
            if status == "err":
                raise RankError(rank, payload[0], payload[1])
            results[rank] = payload
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.1)
        _kill(procs)
