"""Shared set-up of the driver's end-to-end tests: quickstart assets, one `mrl train` subprocess,
metrics read back from the MLflow sqlite store."""
from __future__ import annotations

import os
import random
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


def write_assets(tmp: Path) -> Path:
    """The quickstart's tiny model and data under ``tmp/assets`` (no download). Without the supervised
    warm start (~20 CPU-s, covered by tests/test_quickstart_assets.py): these tests check the
    pipeline, not learning, and a random model exercises it as well."""
    assets = tmp / "assets"
    subprocess.run([sys.executable, "-m", "mrl.quickstarts", "base", "--out", str(assets), "--warm-start-steps", "0"],
                   cwd=ROOT, check=True, capture_output=True, timeout=900)
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
