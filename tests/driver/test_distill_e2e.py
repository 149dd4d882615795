"""`mrl train mrl_configs/quickstart_distill.yaml` end to end on CPU with the teacher on a group of its own
(teacher.placement=separate: 2 actor ranks + 1 teacher rank), the teacher being the student's own checkpoint:
at step 1 (before any update) the reverse KL is 0, after an update it is not, and distill/* reach MLflow."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow


def test_distillation_with_a_separate_teacher(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    p = run_train("mrl_configs/quickstart_distill.yaml", tmp_path, assets, free_port_pair(),
                  f"data.val_files=[{assets}/data/val.jsonl]", f"teacher.path={assets}/tiny-qwen2",
                  "teacher.placement=separate", "teacher.num_devices=1", "cluster.n_gpus_per_node=3",
                  "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
                  f"trainer.default_local_dir={tmp_path}/ckpt", "data.train_batch_size=8", "rollout.n=4",
                  "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    kl = metrics(db, "distill/reverse_kl")
    assert sorted(kl) == [1, 2], kl
    assert abs(kl[1]) <= 1e-6, kl  # teacher = student before the first update
    assert abs(kl[2]) > 1e-5, kl  # the student moved, the teacher did not
    assert all(v < 0 for v in metrics(db, "distill/teacher_logp").values())
    assert "teacher" in p.stdout + p.stderr or metrics(db, "timing_s/teacher")
