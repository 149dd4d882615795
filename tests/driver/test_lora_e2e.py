"""`mrl train mrl_configs/quickstart_lora.yaml` end to end on CPU, 2 steps: LoRA actor (DP=2), reference
= adapters off, merged weights to the embedded engines over the tensor transport (set here: the config's
auto picks inprocess; all tensors on the first sync, only the adapted ones after), a checkpoint with its
lora_config.json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow
SMALL_BATCH = ("data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
               "actor.ppo_micro_batch_size_per_gpu=4")


def _train(tmp: Path, assets: Path, port: int, steps: int):
    return run_train("mrl_configs/quickstart_lora.yaml", tmp, assets, port,
                     f"data.val_files=[{assets}/data/val.jsonl]", f"trainer.total_training_steps={steps}",
                     "trainer.save_freq=2", "trainer.test_freq=2", "trainer.val_before_train=false",
                     f"trainer.default_local_dir={tmp}/ckpt", "rollout.weight_sync.transport=tensor", *SMALL_BATCH)


def test_lora_quickstart_trains_syncs_merged_and_checkpoints(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    port = free_port_pair()
    p = _train(tmp_path, assets, port, 2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    # The engines sample from the merged actor: step 2 generated after a sync of W + (alpha/r)·B·A.
    diff = metrics(db, "training/rollout_probs_diff_max")
    assert sorted(diff) == [1, 2] and all(v < 1e-5 for v in diff.values()), diff
    assert metrics(db, "rollout/engine_weight_version") == {1: 0.0, 2: 1.0}
    # (The reference = base model exactly is checked in tests/workers/test_lora_actor.py; here the KL
    # depends on whether the random tiny model earned any reward before the second mini-batch.)
    assert all(v >= 0 for v in metrics(db, "actor/kl_loss").values())
    nbytes, ntensors = metrics(db, "weight_sync/bytes"), metrics(db, "weight_sync/num_tensors")
    # First sync: all 50 tensors; then only the 7 adapted projections × 4 layers (merged).
    assert ntensors == {1: 50.0, 2: 28.0} and nbytes[2] < nbytes[1], (ntensors, nbytes)
    actor = tmp_path / "ckpt" / "global_step_2" / "actor"
    assert json.loads((actor / "lora_config.json").read_text())["rank"] == 16

    p = _train(tmp_path, assets, port, 3)  # resume_mode=auto: adapters + Adam state from global_step_2
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    diff = metrics(db, "training/rollout_probs_diff_max")
    assert sorted(diff) == [1, 2, 3] and diff[3] < 1e-5, diff  # the fresh engines got the resumed merged weights
    # The resumed run's first sync (before step 3 generates: all 50 tensors, the engines restarted from the
    # base model) is not a step metric; the sync after step 3's update sends only the adapted ones again.
    assert metrics(db, "weight_sync/num_tensors")[3] == 28.0
