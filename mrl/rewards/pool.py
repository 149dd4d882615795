"""A process pool that scores samples with a hard per-call timeout.

``concurrent.futures`` cannot stop a running call, so a scorer stuck in a loop would hang the
trainer. Here each worker runs one call at a time over its own pipe; a call that exceeds
``timeout_s`` gets its worker SIGKILLed and replaced, and the call is reported as an error. Workers
start with ``spawn`` by default: the driver holds threads (Ray, MLflow) and ``fork`` of a
threaded process can deadlock.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from mrl.rewards.outcome import Outcome, score_one
from mrl.rewards.registry import ScoreFn, get_reward_fn


def _worker_main(conn: Connection, spec: str | ScoreFn) -> None:
    try:
        fn = get_reward_fn(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        idx, kwargs = msg
        # Checked here, not in the parent: the parent receives only floats, strings and None, never
        # an object whose class it would have to import (a scorer's own types).
        conn.send((idx, score_one(fn, kwargs)))


class _Worker:
    def __init__(self, ctx: Any, spec: str | ScoreFn) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True)
        self.proc.start()
        child.close()
        self.task: int | None = None
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(2)
        self.kill()


class ScoringPool:
    """``workers`` processes running ``spec``; ``map`` returns one ``Outcome`` per kwargs dict, in order."""

    startup_timeout_s = 60.0

    def __init__(self, spec: str | ScoreFn, workers: int, timeout_s: float, mp_context: str = "spawn") -> None:
        if workers < 1:
            raise ValueError(f"ScoringPool needs workers >= 1, got {workers} (reward.workers=0 scores in process)")
        self.spec, self.n, self.timeout_s = spec, workers, timeout_s
        self._ctx = mp.get_context(mp_context)
        self._workers: list[_Worker] = []

    def _ensure(self) -> None:
        """Top the pool up to ``n`` live workers (on first use and after kills), started in parallel."""
        self._workers = [w for w in self._workers if w.proc.is_alive() and not w.conn.closed]
        fresh = [_Worker(self._ctx, self.spec) for _ in range(self.n - len(self._workers))]
        for w in fresh:
            # Wait until the scorer is imported before any call's clock starts: a loaded host can
            # take seconds to spawn an interpreter, which must not count against timeout_s.
            msg = w.conn.recv() if w.conn.poll(self.startup_timeout_s) else ("init_error", "no answer")
            if msg[0] != "ready":
                for x in fresh:
                    x.kill()
                raise RuntimeError(
                    f"reward worker could not load reward.function={self.spec!r} within "
                    f"{self.startup_timeout_s}s: {msg[1]}; fix the function, or set reward.workers=0 to debug it in process"
                )
        self._workers += fresh

    def map(self, calls: list[dict[str, Any]]) -> list[Outcome]:
        out: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        while True:
            if pending and len(self._workers) < self.n:
                self._ensure()
            for w in list(self._workers):
                if w.task is None and pending:
                    task = pending[0]
                    try:
                        w.conn.send((task, calls[task]))
                    except (BrokenPipeError, OSError):  # died while idle (OOM killer, ...): replace it
                        w.kill()
                        self._workers.remove(w)
                        continue
                    pending.popleft()
                    # The clock starts when the call is handed to a ready worker.
                    w.task, w.deadline = task, time.monotonic() + self.timeout_s
            if pending and not self._workers:
                continue  # every worker died on send: _ensure restarts them
            busy = [w for w in self._workers if w.task is not None]
            if not busy:
                break
            wait_s = max(0.0, min(w.deadline for w in busy) - time.monotonic())
            ready = set(wait([w.conn for w in busy], timeout=wait_s))
            for w in busy:
                task = w.task
                if w.conn in ready:
                    try:
                        idx, outcome = w.conn.recv()
                        out[idx] = outcome
                        w.task = None
                        continue
                    except (EOFError, OSError):
                        w.proc.join(2)  # reap it so that its exit code can be reported
                        out[task] = Outcome(None, None, error=f"scoring worker exited (code {w.proc.exitcode}) "
                                                              f"while scoring sample {task}")
                elif time.monotonic() >= w.deadline:
                    out[task] = Outcome(None, None, error=f"TimeoutError: scoring sample {task} took more than "
                                                          f"timeout_s={self.timeout_s}s")
                else:
                    continue
                w.kill()  # replaced by _ensure at the top of the loop, all replacements at once
                self._workers.remove(w)
        return [o if o is not None else Outcome(None, None, error="not scored") for o in out]

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []
