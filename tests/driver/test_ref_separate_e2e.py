"""`mrl train` with the reference on ranks of its own (ref.placement=separate: 2 more CPU ranks, its own group,
world and layout, TP2; the actor TP1 on 1): ``ref_log_prob`` comes from those ranks (the trainer ranks
hold no reference then, so an answer from them would fail the run) and the KL loss reads it.

Step 1 updates once (one mini-batch per step), at the start weights, so its KL loss is that of the start policy
against the reference: exactly 0 colocated (the same weights through the same forward), and for the separate
reference loaded from model.path only round-off. Per token Δ = log π - log π_ref is a TP2 vs TP1 fp32 forward's
difference, |Δ| ≲ 1e-5 (a log-softmax of values of order 10 summed in another order), so the true k3
(low_var_kl) e^{-Δ} + Δ - 1 = Δ²/2 + O(Δ³) ≤ 5e-11; evaluated in fp32 near 1 it is off by at most about two
ulps of 1 (exp's rounding, then the subtraction's): 2.4e-7 per token, and so for their mean. The bound 1e-6
leaves 4x; a reference of any other weights gives a KL orders of magnitude above it. Step 2 (the actor updated
once at lr 1e-3) shows the metric is live: its KL is well above that bound."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow

KL_ROUNDOFF = 1e-6  # module doc: 2 fp32 ulps of 1 (2.4e-7) + (1e-5)^2 / 2, with 4x room


def test_separate_reference_answers_ref_log_prob(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    p = run_train("mrl_configs/quickstart.yaml", tmp_path, assets, free_port_pair(),
                  f"data.val_files=[{assets}/data/val.jsonl]", "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
                  "trainer.save_freq=-1", f"trainer.default_local_dir={tmp_path}/ckpt",
                  "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                  "actor.ppo_micro_batch_size_per_gpu=8", "actor.use_kl_loss=true", "actor.kl_loss_type=low_var_kl",
                  "cluster.n_gpus_per_node=3", "ref.placement=separate", "ref.num_devices=2",
                  "ref.megatron.tensor_model_parallel_size=2", "ref.log_prob_micro_batch_size_per_gpu=4")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert "reference ranks: 2 of their own, built (TP=2 PP=1 CP=1)" in p.stderr + p.stdout  # the group is up
    db = tmp_path / "mlflow.db"
    kl = metrics(db, "actor/kl_loss")
    assert sorted(kl) == [1, 2], kl
    assert abs(kl[1]) < KL_ROUNDOFF, kl  # the start policy against a reference of the same weights
    assert kl[2] > 100 * KL_ROUNDOFF, kl  # the updated actor against the frozen reference
    assert all(v > 0 for v in metrics(db, "timing_s/ref").values())
    print(f"actor/kl_loss: step 1 {kl[1]:.3e}, step 2 {kl[2]:.3e}")
