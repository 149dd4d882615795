"""Shared set-up of the driver's end-to-end tests: quickstart assets, one `mrl train` subprocess,
metrics read back from the MLflow sqlite store."""
from __future__ import annotations

import os
import random
import shutil
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.helpers.asset_cache import cached, copy_of
from tests.helpers.ray_cluster import shared_ray

ROOT = Path(__file__).resolve().parents[2]


def free_port_pair() -> int:
    """A port p with p and p + 1 free (the two engines of a run bind port_base + i), drawn below
    the kernel's ephemeral range (32768+) and above Ray's worker ports (10002-19999): Ray, gloo and
    every bind(0) pick ephemeral ports while the run starts, and one of them took an engine's port
    between this check and the engine's bind under a loaded CI host."""
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(20000, 32000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports in 20000-32000")


def _write_random_base(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "mrl.quickstarts", "base", "--out", str(out), "--warm-start-steps", "0"],
                   cwd=ROOT, check=True, capture_output=True, timeout=900)


def write_assets(tmp: Path) -> Path:
    """The quickstart's tiny model and data under ``tmp/assets`` (no download). Without the supervised
    warm start (~20 CPU-s, covered by tests/quickstarts/test_base_assets.py): these tests check the
    pipeline, not learning, and a random model exercises it as well. Written once per test session
    (tests/helpers/asset_cache.py; a subprocess of ~6 s idle, ~20 test files use it) and copied: each
    test gets its own files to change."""
    return copy_of("quickstart-random", _write_random_base, tmp / "assets")


def _write_warm_base(out: Path) -> None:
    from mrl.quickstarts.base import write_assets as write_base

    write_base(out)  # with the quickstart's supervised warm start, as `make train` writes it


def write_warm_assets(dest: Path) -> Path:
    """The quickstart's assets as `python -m mrl.quickstarts base` writes them (warm start included, ~20
    CPU-s) at ``dest``: written once per test session and copied (the RM and judge recipes train on them)."""
    return copy_of("quickstart-warm", _write_warm_base, dest)


AGENT_WARM_START_STEPS = 120  # enough for the call format (some calls malformed: their error is a tool message too)


def _write_agent(out: Path) -> None:
    from mrl.quickstarts.agent import write_assets as write_agent

    write_agent(out, warm_start_steps=AGENT_WARM_START_STEPS)  # the demo's 800 steps teach the task, not needed here


def write_agent_assets(dest: Path) -> Path:
    """The agent quickstart's model (warm-started for the tool-call format only: ~30 CPU-s) and data at ``dest``,
    written once per test session and copied."""
    return copy_of("agent-warm", _write_agent, dest)


def _write_empty_mlflow_store(out: Path) -> None:
    from mlflow.tracking import MlflowClient

    out.mkdir(parents=True)
    MlflowClient(f"sqlite:///{out}/mlflow.db").search_experiments()  # creates the file and migrates its schema


def mlflow_db(path: Path) -> Path:
    """``path`` (an ``mlflow.db`` a run will log to): when absent, a copy of an empty MLflow store whose schema
    is made once per test session. MLflow migrates a new SQLite file through its whole schema history (~1.7
    CPU-s, ~25 runs in the suite); the run then logs to an up-to-date store, as a user's second run does."""
    if not path.exists():
        shutil.copyfile(cached("mlflow-empty", _write_empty_mlflow_store) / "mlflow.db", path)
    return path


def run_train(config: str, tmp: Path, assets: Path, port: int, *overrides: str,
              own_ray: bool = False) -> subprocess.CompletedProcess:
    """``mrl train config`` on the assets, logging to ``tmp/mlflow.db``; returns the finished process. The run
    joins the test session's Ray instance (tests/helpers/ray_cluster.py) unless ``own_ray``: then it starts
    its own, as ``make train`` does. Its run directory (checkpoints, metrics.log) is ``tmp/checkpoints`` unless
    ``overrides`` name another: the run's working directory is the repository, and the config's default
    (checkpoints/<project>/<experiment>) would write into the working tree (.ci/run checks it stays unchanged)."""
    cmd = [sys.executable, "-m", "mrl", "train", config, f"model.path={assets}/tiny-qwen2",
           f"data.train_files=[{assets}/data/train.jsonl]",
           f"trainer.mlflow_tracking_uri=sqlite:///{mlflow_db(tmp / 'mlflow.db')}",
           f"trainer.default_local_dir={tmp}/checkpoints",  # the last of repeated keys wins: overrides may move it
           f"rollout.port_base={port}", *overrides]
    env = train_env(cmd) if not own_ray else {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    # ~60-140 s idle; headroom for a loaded CI host
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def train_env(cmd: list[str]) -> dict[str, str]:
    """Join an ``mrl train`` command line to the test session's Ray instance (appends ``cluster.address``); returns
    the environment to run it in (the instance's token). Starting a Ray of its own costs a run ~10 s of CPU."""
    address, auth = shared_ray()
    cmd.append(f"cluster.address={address}")
    return {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", **auth}


def metrics(db: Path, key: str) -> dict[int, float]:
    """{step: value} of one metric in the MLflow sqlite store."""
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT step, value FROM metrics WHERE key = ?", (key,)).fetchall()
    return dict(rows)


def _write_vlm(out: Path) -> None:
    from mrl.quickstarts import vlm

    # the demo's format-only warm start (~10 CPU-s): a random model never names a colour, so every reward and
    # every GRPO advantage would be 0 and no gradient would show an update ran
    vlm.write_model(out / vlm.MODEL_DIR, seed=0, steps=vlm.WARM_START_STEPS)
    vlm.write_data(out / "data", seed=0, blank=False)


def write_vlm_assets(dest: Path) -> Path:
    """The vision-language quickstart's model (format-only warm start) and data at ``dest``, as `python -m
    mrl.quickstarts vlm` writes them: written once per test session and copied."""
    return copy_of("vlm-warm", _write_vlm, dest)
