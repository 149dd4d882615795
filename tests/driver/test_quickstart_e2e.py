"""`mrl train mrl_configs/quickstart.yaml` end to end on CPU: 2 steps, checkpoint, resume for 1 more.

Real components throughout: Ray rank actors with Megatron GPTModel (gloo, DP=2), two embedded
engine processes, tensor-transport weight sync, the arith scorer and an MLflow sqlite store.
"""
from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
        if p < 65000:
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 1))
                    return p
                except OSError:
                    continue
    raise RuntimeError("no two consecutive free ports")


def _train(tmp: Path, assets: Path, steps: int, port: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart.yaml",
           f"model.path={assets}/tiny-qwen2", f"data.train_files=[{assets}/data/train.jsonl]",
           f"data.val_files=[{assets}/data/val.jsonl]", f"trainer.total_training_steps={steps}",
           "trainer.save_freq=2", "trainer.test_freq=2", f"trainer.default_local_dir={tmp}/ckpt",
           f"trainer.mlflow_tracking_uri=sqlite:///{tmp}/mlflow.db", f"rollout.port_base={port}"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)  # ~100 s idle; headroom for a loaded CI host


def _metrics(db: Path, key: str) -> dict[int, float]:
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT step, value FROM metrics WHERE key = ?", (key,)).fetchall()
    return dict(rows)


def test_quickstart_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    subprocess.run([sys.executable, "-m", "mrl.quickstart", "--out", str(assets)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    port = _free_port_pair()
    p = _train(tmp_path, assets, 2, port)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    score = _metrics(db, "critic/score/mean")
    assert sorted(score) == [1, 2] and all(0.0 <= v <= 1.0 for v in score.values())
    assert sorted(_metrics(db, "actor/pg_loss")) == [1, 2]
    assert sorted(_metrics(db, "val-core/arith/reward/mean_at_1")) == [2]
    # The engines themselves reported the version they generated with: start weights at step 1,
    # the version pushed after step 1 at step 2.
    assert _metrics(db, "rollout/engine_weight_version") == {1: 0.0, 2: 1.0}
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    state = json.loads((ckpt / "global_step_2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["weight_version"] == 2
    assert (ckpt / "global_step_2" / "actor" / "metadata.json").is_file()

    p = _train(tmp_path, assets, 3, port)  # resume_mode=auto picks up global_step_2
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    # resumed weights were pushed as version 2 before step 3 generated
    assert _metrics(db, "rollout/engine_weight_version")[3] == 2.0
    assert sorted(_metrics(db, "critic/score/mean")) == [1, 2, 3]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"
