"""Run one function on N local ranks in fresh processes, with a deadline and clean-up.

The one launcher of mrl's local multi-rank work: ``mrl-ckpt`` conversions and the test suite's
gloo ranks. Each rank is a fresh ``spawn`` process (Megatron's ``parallel_state`` and CUDA cannot
be forked safely), or, with ``preload``, a fork of a ``forkserver`` that imported those modules once
and never initialised either (~2 s of imports per rank become ~20 ms; the rank gets the caller's
current environment, not the server's). Each rank runs in a process group of its own, so the writer
processes ``dist_checkpointing.save`` forks die with it. Results come back pickled by value (the
queue's own pickler would send tensors as shared-memory handles that die with the rank before the
parent reads them); they are this launcher's own children's results, never outside input. The first
failing rank stops the job: every rank is killed and its message is raised in the parent as
:class:`RankError` (one message, not N interleaved tracebacks); a rank that dies without a word, or a
job past its deadline, too.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import sys
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


def _teardown() -> None:
    """Best effort on the way out: Megatron's groups, then torch.distributed's default group."""
    if "megatron.core.parallel_state" in sys.modules:
        from mrl.megatron.parallel import destroy_parallel

        with contextlib.suppress(Exception):
            destroy_parallel()
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()


def _die_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """A rank runs in a process group of its own (below), so a killed parent's terminal signal does not
    reach it: it watches the parent and takes its whole group (its checkpoint writers) down when it is gone."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="mrl-rank-parent-watch", daemon=True).start()


def _entry(fn: Callable, rank: int, world_size: int, port: int, threads: int | None, args: tuple, queue: Any,
           parent: int | None = None, env: dict[str, str] | None = None) -> None:
    os.setpgrp()  # own process group: the parent can kill this rank and its writer children
    if parent is not None:  # 0: a forkserver's child, whose parent is the server (it dies with the caller)
        _die_with_parent(parent or os.getppid())
    if env is not None:  # a forkserver's child starts with the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if threads is not None:  # ranks share the host's cores; oversubscribing them slows every collective
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)
    try:
        queue.put((rank, "ok", pickle.dumps(fn(rank, *args))))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        queue.put((rank, "err", (f"{type(e).__name__}: {e}", traceback.format_exc())))
    finally:
        _teardown()


def _kill(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:  # SIGKILLed: this returns as soon as each is reaped; the bound only covers a host under heavy load,
        p.join(timeout=30)  # where a rank in the middle of a disk write can take seconds to go (and the caller's
        # clean-up of its output directory must not race a rank still writing into it)


def run_local_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), *, timeout_s: float,
                    threads_per_rank: int | None = None, timeout_hint: str = "",
                    preload: Sequence[str] = ()) -> list[Any]:
    """``fn(rank, *args)`` on ``world_size`` ranks (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK set);
    results by rank, or :class:`RankError` / ``TimeoutError`` (``timeout_hint`` appended: the fix).

    ``preload``: modules a forkserver imports once per calling process, the ranks being its forks. Only
    for modules that neither start threads nor touch CUDA on import (torch, megatron.core on CPU); the
    server keeps the preload list of its first call."""
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        parent, env = 0, dict(os.environ)
    else:
        ctx, parent, env = mp.get_context("spawn"), os.getpid(), None
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, threads_per_rank, tuple(args), queue, parent, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(results)}/{world_size} ranks finished within {timeout_s:.0f}s{timeout_hint}")
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except (queue_mod.Empty, OSError, EOFError):  # check for ranks that died without a word
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    raise RankError(dead[0], f"process died with exit code {procs[dead[0]].exitcode} "
                                    "(killed for memory? try fewer ranks or a smaller dtype)", "") from None
                continue
            if status == "err":
                raise RankError(rank, payload[0], payload[1])
            results[rank] = pickle.loads(payload)
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=10 if len(results) == world_size else 0.1)
        _kill(procs)
