"""One Ray instance per test session, joined by the end-to-end runs' ``mrl train`` (``cluster.address``) of every
pytest-xdist worker.

A run that starts its own instance (``ray.init(address="local")``, what ``make train`` does) pays for
Ray's start and stop: ~5.5 CPU-s and ~4.5 s of 14.6 s on an idle host for a 2-step quickstart run (GCS,
raylet, their agents and monitors; measured 2026-11-28, docs/testing.md), ~25 such runs in the suite. Runs that test the
pipeline, not Ray's start, join this one instead, as a user's run joins a cluster started with
``ray start``. The local start keeps its own tests: the in-process end-to-end run (``make train``'s path),
the fault-injection runs that kill a rank (they check the run's own process tree), the full-disk and plugin
runs, tests/cluster/.

One instance for the whole session, not one per worker: an idle instance still costs ~3 % of a core (raylet,
log monitor, GCS, two prestarted workers; measured 2026-11-28), i.e. ~30 CPU-s over a 16-minute suite, besides
its start. Runs of both workers share it without meeting: mrl names no actor, and its placement groups and
actors belong to the run's own job. ``NUM_CPUS`` leaves room for two runs at once.

It is started by the first test that asks (no Ray for a session that runs no end-to-end test): a small holder
process (``mrl.cluster.init_ray`` with the local token authentication a user's run gets) writes the address and
token to ``ray.json`` in the session's cache directory (tests/helpers/asset_cache.py), where the other worker
finds it under a file lock. The process that started the session stops it at the end (tests/conftest.py:
:func:`stop_session_ray`), and the holder also stops Ray by itself once that process is gone (killed). Rank
processes inherit the holder's environment, not the calling test's: a test that sets variables for its ranks
starts its own instance (``run_train(..., own_ray=True)``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from filelock import FileLock

from tests.helpers.asset_cache import cache_root

ROOT = Path(__file__).resolve().parents[2]
SESSION_PID = "MRL_TEST_SESSION_PID"  # set by tests/conftest.py in the process that starts the session

# Logical CPUs: each rank takes one; with slack so that two workers' runs fit at once and a run's placement
# groups never wait for the previous run's ranks to be reaped.
NUM_CPUS = 32

_HOLDER = r"""
import json, os, signal, sys, time
import ray
from mrl.cluster import init_ray
session, out = int(sys.argv[1]), sys.argv[2]
init_ray(None, num_cpus=int(sys.argv[3]))
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))  # after ray.init, which installs its own
with open(out + ".tmp", "w", opener=lambda p, f: os.open(p, f, 0o600)) as f:
    json.dump({"address": ray.get_runtime_context().gcs_address, "token": os.environ["RAY_AUTH_TOKEN"],
               "pid": os.getpid()}, f)
os.replace(out + ".tmp", out)
while not stop:  # until the session's process stops it, or is gone
    try:
        os.kill(session, 0)
    except ProcessLookupError:
        break
    time.sleep(0.5)
ray.shutdown()
"""

_cluster: tuple[str, dict[str, str]] | None = None


def _state() -> Path:
    return cache_root() / "ray.json"


def shared_ray(timeout_s: float = 300.0) -> tuple[str, dict[str, str]]:
    """(GCS address, the environment a client needs to join it: its token), started on first use."""
    global _cluster
    if _cluster is None:  # a test worker runs one test at a time
        state = _state()
        with FileLock(str(state) + ".lock", timeout=timeout_s):
            if not state.is_file():
                session = os.environ.get(SESSION_PID, str(os.getpid()))
                with open(state.parent / "ray_holder.log", "ab") as log:
                    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
                    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, session, str(state), str(NUM_CPUS)],
                                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                            start_new_session=True)  # outlives this worker: the session stops it
                deadline = time.monotonic() + timeout_s
                while not state.is_file():  # Ray's start: seconds
                    if proc.poll() is not None or time.monotonic() > deadline:
                        proc.kill()
                        raise RuntimeError(f"the shared Ray instance did not start (exit code {proc.poll()}); "
                                           f"its log: {state.parent / 'ray_holder.log'}")
                    time.sleep(0.1)
            info = json.loads(state.read_text())
        _cluster = (info["address"], {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": info["token"]})
    return _cluster


def stop_session_ray(timeout_s: float = 60.0) -> None:
    """Stop the session's instance, if a test started one (the session's process, at its end)."""
    import psutil

    state = _state()
    if not state.is_file():
        return
    pid = json.loads(state.read_text())["pid"]
    try:
        holder = psutil.Process(pid)
        holder.send_signal(signal.SIGTERM)  # ray.shutdown(), then it exits
        holder.wait(timeout=timeout_s)
    except psutil.TimeoutExpired:
        holder.kill()
    except psutil.NoSuchProcess:
        pass
    state.unlink()
