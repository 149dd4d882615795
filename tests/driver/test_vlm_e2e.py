"""`mrl train` of the vision-language quickstart (tiny Qwen2.5-VL, pictures in the prompt file) on CPU, 2 gloo ranks:
two steps train; the engines, sent the engine ids + SGLang's image_data, sample with the probabilities the Megatron
actor computes from the expanded ids + the processor's pixels (fp32: the 1e-5 of the text quickstart,
tests/driver/test_inprocess_e2e.py); the frozen vision tower leaves the weight sync after the first one."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_vlm_assets

pytestmark = pytest.mark.slow


def test_vlm_quickstart_trains_and_engines_follow_the_actor(tmp_path: Path) -> None:
    assets = write_vlm_assets(tmp_path / "assets")
    p = run_train("mrl_configs/quickstart_vlm.yaml", tmp_path, assets, free_port_pair(),
                  f"model.path={assets}/tiny-qwen2_5_vl", f"data.val_files=[{assets}/data/val.jsonl]",
                  "trainer.total_training_steps=2", "trainer.val_before_train=false", "trainer.test_freq=0",
                  "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                  "actor.ppo_micro_batch_size_per_gpu=16")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    diff = metrics(db, "training/rollout_probs_diff_max")
    assert sorted(diff) == [1, 2] and all(v < 1e-5 for v in diff.values()), diff
    grad = metrics(db, "actor/grad_norm")
    assert sorted(grad) == [1, 2] and all(v > 0 for v in grad.values()), grad
    sent = metrics(db, "weight_sync/num_tensors")  # the tower's tensors only in the first sync
    assert sent[2] < sent[1], sent
