"""`mrl train mrl_configs/quickstart_distill.yaml` end to end on CPU with the teacher on a group of its own
(teacher.placement=separate: 2 actor ranks + 1 teacher rank): the teacher is another checkpoint of the student's
shape and tokenizer (another seed), so the reverse KL is positive; distill/* and the phase's timing reach MLflow.
(A teacher equal to the student gives 0: tests/workers/test_teacher.py.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import ROOT, free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow


def test_distillation_with_a_separate_teacher(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    teacher = tmp_path / "teacher"
    subprocess.run([sys.executable, "-m", "mrl.quickstarts", "base", "--out", str(teacher), "--seed", "1",
                    "--warm-start-steps", "0"], cwd=ROOT, check=True, capture_output=True, timeout=900)
    p = run_train("mrl_configs/quickstart_distill.yaml", tmp_path, assets, free_port_pair(),
                  f"data.val_files=[{assets}/data/val.jsonl]", f"teacher.path={teacher}/tiny-qwen2",
                  "teacher.placement=separate", "teacher.num_devices=1", "cluster.n_gpus_per_node=3",
                  "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
                  f"trainer.default_local_dir={tmp_path}/ckpt", "data.train_batch_size=8", "rollout.n=4",
                  "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    kl = metrics(db, "distill/reverse_kl")
    assert sorted(kl) == [1, 2] and all(v > 1e-3 for v in kl.values()), kl  # two random models disagree
    t, s = metrics(db, "distill/teacher_logp"), metrics(db, "distill/student_logp")
    assert all(t[k] < 0 and s[k] < 0 for k in (1, 2)), (t, s)
    assert all(abs(s[k] - t[k] - kl[k]) < 1e-5 for k in (1, 2))  # the metric is the mean log-ratio
    assert sorted(metrics(db, "timing_s/teacher")) == [1, 2]
