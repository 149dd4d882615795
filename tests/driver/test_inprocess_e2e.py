"""`mrl train` with rollout.weight_sync.transport=inprocess on CPU (the quickstart's default: auto resolves to it): each of the 2 gloo ranks hosts its engine
(no engine processes), loads its own weights into it after every update, and the engines then sample
from the updated actor's distribution (engine vs trainer probabilities, as with the other transports)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow

SMALL_BATCH = ("data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
               "actor.ppo_micro_batch_size_per_gpu=4")


def test_inprocess_engines_train_and_follow_the_actor(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    p = run_train("mrl_configs/quickstart.yaml", tmp_path, assets, free_port_pair(),
                  f"data.val_files=[{assets}/data/val.jsonl]", "trainer.total_training_steps=3", "trainer.test_freq=3",
                  "trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path}/ckpt",
                  "rollout.weight_sync.verify=true",  # transport and shared_prefix: the quickstart's auto -> inprocess, on
                  *SMALL_BATCH, own_ray=True)  # the quickstart as `make train` runs it: its own Ray instance
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    # the engines generated with the start weights, then with each pushed version
    assert metrics(db, "rollout/engine_weight_version") == {1: 0.0, 2: 1.0, 3: 2.0}
    # ... and those are the actor's weights: fp32 engine vs Megatron actor probabilities (steps 2-3 after a sync)
    diff = metrics(db, "training/rollout_probs_diff_max")
    assert sorted(diff) == [1, 2, 3] and all(v < 1e-5 for v in diff.values()), diff
    # both ranks loaded their own engine (bytes summed over ranks: two whole models), verified by checksum
    sent = metrics(db, "weight_sync/bytes")
    assert sorted(sent) == [1, 2, 3] and len(set(sent.values())) == 1 and min(sent.values()) > 0
    assert 0.0 <= metrics(db, "val-core/arith/reward/mean_at_1")[3] <= 1.0
    assert not list((tmp_path / "ckpt").rglob("engine_*.log"))  # no engine server processes were started
