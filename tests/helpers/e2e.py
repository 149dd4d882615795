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


_ASSETS_CACHE: dict[str, Path] = {}


def write_assets(tmp: Path) -> Path:
    """The quickstart's tiny model and data under ``tmp/assets`` (no download). Without the supervised
    warm start (~20 CPU-s, covered by tests/test_quickstart_assets.py): these tests check the
    pipeline, not learning, and a random model exercises it as well. Written once per test process
    (a subprocess of ~6 s idle, ~20 test files use it) and copied: each test gets its own files to change."""
    assets = tmp / "assets"
    if "base" not in _ASSETS_CACHE:
        import atexit
        import tempfile

        src = Path(tempfile.mkdtemp(prefix="mrl_e2e_assets_")) / "assets"
        atexit.register(shutil.rmtree, src.parent, True)
        subprocess.run([sys.executable, "-m", "mrl.quickstarts", "base", "--out", str(src), "--warm-start-steps", "0"],
                       cwd=ROOT, check=True, capture_output=True, timeout=900)
        _ASSETS_CACHE["base"] = src
    shutil.copytree(_ASSETS_CACHE["base"], assets)
    return assets


def run_train(config: str, tmp: Path, assets: Path, port: int, *overrides: str) -> subprocess.CompletedProcess:
    """``mrl train config`` on the assets, logging to ``tmp/mlflow.db``; returns the finished process."""
    cmd = [sys.executable, "-m", "mrl", "train", config, f"model.path={assets}/tiny-qwen2",
           f"data.train_files=[{assets}/data/train.jsonl]", f"trainer.mlflow_tracking_uri=sqlite:///{tmp}/mlflow.db",
           f"rollout.port_base={port}", *overrides]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_AUTH_MODE": "disabled"}
    # ~60-140 s idle; headroom for a loaded CI host
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def metrics(db: Path, key: str) -> dict[int, float]:
    """{step: value} of one metric in the MLflow sqlite store."""
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT step, value FROM metrics WHERE key = ?", (key,)).fetchall()
    return dict(rows)
