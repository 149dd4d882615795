"""One Ray instance per test worker process, joined by the end-to-end runs' ``mrl train`` (``cluster.address``).

A run that starts its own instance (``ray.init(address="local")``, what ``make train`` does) pays for
Ray's start and stop: ~5.5 CPU-s and ~4.5 s of 14.6 s on an idle host for a 2-step quickstart run (GCS,
raylet, their agents and monitors; measured 2026-11-28, docs/testing.md), ~25 such runs in the suite. Runs that test the
pipeline, not Ray's start, join this one instead, as a user's run joins a cluster started with
``ray start``. The local start keeps its own tests: the quickstart and in-process end-to-end runs, the
fault-injection runs (they check the run's own process tree), tests/cluster/.

The instance is held by a small subprocess (``mrl.cluster.init_ray`` with the local token
authentication a user's run gets) that reads its stdin until the test worker closes it: at the
worker's exit, or when the worker dies, the pipe closes and the holder shuts Ray down. Rank processes
inherit the holder's environment, not the calling test's: a test that sets variables for its ranks
starts its own instance (``run_train(..., own_ray=True)``).
"""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Logical CPUs: each rank takes one; with slack so that a run's placement groups never wait for the
# previous run's ranks to be reaped.
NUM_CPUS = 32

_HOLDER = r"""
import os, sys
import ray
from mrl.cluster import init_ray
init_ray(None, num_cpus=int(sys.argv[1]))
print(ray.get_runtime_context().gcs_address, os.environ["RAY_AUTH_TOKEN"], flush=True)
sys.stdin.read()  # until the test worker closes the pipe (it exited or died)
ray.shutdown()
"""

_cluster: tuple[str, dict[str, str]] | None = None


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(timeout=30)


def shared_ray() -> tuple[str, dict[str, str]]:
    """(GCS address, the environment a client needs to join it: its token), started on first use."""
    global _cluster
    if _cluster is None:  # a test worker runs one test at a time
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(NUM_CPUS)], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        atexit.register(_stop, proc)
        line = proc.stdout.readline().split()  # Ray's start: seconds; the holder exits on a failure
        if len(line) != 2:
            _stop(proc)
            raise RuntimeError(f"the shared Ray instance did not start (exit code {proc.poll()})")
        address, token = line
        _cluster = (address, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    return _cluster
