"""`mrl train` with rollout.router=sglang_router: the driver launches SGLang's router (the
sglang_router package) in front of its two embedded engines and generates through it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow


def test_quickstart_step_through_sglang_router(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    p = run_train("mrl_configs/quickstart.yaml", tmp_path, assets, free_port_pair(), "rollout.router=sglang_router",
                  f"data.val_files=[{assets}/data/val.jsonl]",
                  f"rollout.router_port={free_port_pair()}", "trainer.total_training_steps=2",
                  "trainer.val_before_train=false", "trainer.test_freq=0", f"trainer.default_local_dir={tmp_path}/ckpt",
                  "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                  "actor.ppo_micro_batch_size_per_gpu=8")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    assert sorted(metrics(db, "critic/score/mean")) == [1, 2]
    # step 2 generated through the router with the weights synced after step 1 (a stale engine
    # would fail the step), and the samples still match the actor's distribution
    assert metrics(db, "rollout/engine_weight_version") == {1: 0.0, 2: 1.0}
    assert all(v < 1e-5 for v in metrics(db, "training/rollout_probs_diff_max").values())
    log = (tmp_path / "ckpt" / "logs" / "sglang_router.log").read_text()
    assert "/generate" in log  # the requests went through SGLang's router
