"""`mrl train` of the quickstart at actor.megatron.context_parallel_size=2 on CPU (2 gloo ranks: CP2, DP1; the colocated
reference on the actor's model at CP2 too): two steps train, and the engines, loaded after each update with the
weights the CP ranks trained, sample with the probabilities the CP actor computes (engine vs trainer, fp32: the
same 1e-5 as at CP1, tests/driver/test_inprocess_e2e.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow

SMALL_BATCH = ("data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
               "actor.ppo_micro_batch_size_per_gpu=4")


def test_quickstart_trains_at_cp2_and_engines_follow_the_actor(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    p = run_train("mrl_configs/quickstart.yaml", tmp_path, assets, free_port_pair(),
                  "actor.megatron.context_parallel_size=2", "trainer.total_training_steps=2",
                  f"data.val_files=[{assets}/data/val.jsonl]",
                  "trainer.val_before_train=false", "trainer.test_freq=0", f"trainer.default_local_dir={tmp_path}/ckpt",
                  *SMALL_BATCH)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    assert metrics(db, "rollout/engine_weight_version") == {1: 0.0, 2: 1.0}
    diff = metrics(db, "training/rollout_probs_diff_max")
    assert sorted(diff) == [1, 2] and all(v < 1e-5 for v in diff.values()), diff
    grad = metrics(db, "actor/grad_norm")
    assert sorted(grad) == [1, 2] and all(v > 0 for v in grad.values()), grad
