"""The quickstart for 2 steps with seed 003's ref_reward_blend and repr_align both on (CPU, real stack).

Linear schedules with warmup_ratio 0.5 of 2 steps: w = 0 on step 1 and max_weight on step 2, so
step 1's rewards equal the scores exactly and step 2's do not. The entropy threshold is 0, so
the alignment runs (two reference forwards through the Ray ranks) on both steps; the skip path
is covered by tests/driver/test_shaping.py.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.driver.test_quickstart_e2e import ROOT, _free_port_pair, _metrics

pytestmark = pytest.mark.slow
BLEND, ALIGN = "actor/ref_blend", "actor/repr/ref_gold_align"


def test_quickstart_with_ref_blend_and_repr_align(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    subprocess.run([sys.executable, "-m", "mrl.quickstart", "--out", str(assets)], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)
    cmd = [sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart.yaml",
           f"model.path={assets}/tiny-qwen2", f"data.train_files=[{assets}/data/train.jsonl]", "data.val_files=[]",
           "trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.save_freq=0",
           f"trainer.mlflow_tracking_uri=sqlite:///{tmp_path}/mlflow.db", f"rollout.port_base={_free_port_pair()}",
           "algorithm.ref_reward_blend.enable=true", "algorithm.ref_reward_blend.max_weight=0.6",
           "algorithm.ref_reward_blend.warmup_ratio=0.5", "algorithm.ref_reward_blend.schedule=linear",
           "algorithm.repr_align.enable=true", "algorithm.repr_align.ref_alignment.max_weight=0.2",
           "algorithm.repr_align.ref_alignment.warmup_ratio=0.5", "algorithm.repr_align.ref_alignment.schedule=linear",
           "algorithm.repr_align.ref_alignment.entropy_high_threshold=0.0"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_AUTH_MODE": "disabled"}
    p = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    assert _metrics(db, f"{BLEND}/weight") == pytest.approx({1: 0.0, 2: 0.6})
    assert _metrics(db, f"{ALIGN}/weight") == pytest.approx({1: 0.0, 2: 0.2})
    assert _metrics(db, f"{ALIGN}/applied") == {1: 1.0, 2: 1.0}
    ent = _metrics(db, f"{ALIGN}/batch_entropy")
    assert sorted(ent) == [1, 2] and all(math.isfinite(v) and v > 0 for v in ent.values())
    lo, mean, hi = (_metrics(db, f"{ALIGN}/similarity/{k}") for k in ("min", "mean", "max"))
    print("entropy", ent, "similarity mean", mean)
    for s in (1, 2):
        assert -1.0 - 1e-6 <= lo[s] <= mean[s] <= hi[s] <= 1.0 + 1e-6, (lo, mean, hi)
    score, reward = _metrics(db, "critic/score/mean"), _metrics(db, "critic/rewards/mean")
    assert all(math.isfinite(v) for v in (*score.values(), *reward.values()))
    assert reward[1] == score[1]  # w = 0 for both terms on step 1
    assert abs(reward[2] - score[2]) > 1e-6  # blended and aligned on step 2
