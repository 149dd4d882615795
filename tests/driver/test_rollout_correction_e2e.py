"""The quickstart for 2 steps with CISPO and verl's rollout correction on (token TIS + a geometric-mean
sequence rejection + a token IcePop-free k1 mask), CPU, real stack: the ``rollout_corr/*`` metrics
are logged every step, finite, and say what they must on fp32 engines that compute the trainer's
model (ratios ~1: nothing rejected, weights ~1)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow
RC = "algorithm.rollout_correction"


def test_quickstart_with_cispo_and_rollout_correction(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    p = run_train("mrl_configs/quickstart.yaml", tmp_path, assets, free_port_pair(), "data.val_files=[]",
                  "trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false",
                  "trainer.save_freq=0", "data.train_batch_size=8", "rollout.n=4",  # 32 samples: pipeline, not learning
                  "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
                  "actor.policy_loss=cispo", f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0",
                  f"{RC}.rollout_rs='seq_mean_k1,token_k1'", f"{RC}.rollout_rs_threshold='0.5_2.0'")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    for key in ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size", "rollout_rs_masked_fraction",
                "rollout_rs_seq_mean_k1_masked_fraction", "kl", "k3_kl", "chi2_token", "training_ppl"):
        got = metrics(db, f"rollout_corr/{key}")
        assert sorted(got) == [1, 2] and all(math.isfinite(v) for v in got.values()), (key, got)
    # the engines run the trainer's fp32 model: log rho ~ 1e-6, so the weights are ~1 and nothing is rejected
    assert all(abs(v - 1) < 1e-3 for v in metrics(db, "rollout_corr/rollout_is_mean").values())
    assert all(v == 0.0 for v in metrics(db, "rollout_corr/rollout_rs_masked_fraction").values())
    assert all(math.isfinite(v) for v in metrics(db, "actor/pg_loss").values())
