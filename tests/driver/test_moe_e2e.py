"""`mrl train mrl_configs/quickstart_moe.yaml` end to end on CPU: a tiny Qwen3-MoE with its experts split
over the 2 ranks (EP2) and routing replay on. The engines return each token's experts, the batch carries
them, the trainer's forwards replay them: the engine's and the trainer's log-probs of the sampled tokens
agree as for a dense model, and the moe/* metrics reach MLflow. Plus the engine command lines with replay.

What this run cannot show: that replay matters. Each step is one on-policy update of the weights the engines
sampled with, in fp32 on both sides (the embedded engine runs transformers, the trainer Megatron), so the
trainer's own routing already is the engine's: moe/replay_mismatch is exactly 0 on both steps (asserted), and
a replay that sets the engine's ids but does not apply them passes this test too (tried: the router's
``REPLAY_FORWARD`` action left unset in mrl/workers/routing_replay.py, still green). Replay's effect — the
trainer's log-probs become the engine's where its own routing differs — is shown in
tests/workers/test_moe_actor.py (router rows in a near-tie flipped between engine and trainer: 31% of the
routed tokens differ, log-probs off by up to 0.30 without replay, ≤ 1e-5 with it), and its off-policy
mini-batches (a second mini-batch after an optimizer step, R3 and R2) read the routing each forward used: the
replayed ids at every position, where the trainer's own routing differs on 17-31% of the token-layers. That is
the check in which replay must matter, at a worker's cost instead of another end-to-end run of this length."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mrl.config import load_config
from mrl.driver.engines import engine_command, plan_engines
from tests.driver.test_engines import _gpu_infos, _node
from tests.helpers.e2e import ROOT, free_port_pair, metrics, mlflow_db, train_env

pytestmark = pytest.mark.slow


def test_moe_quickstart_trains_with_expert_parallel_and_routing_replay(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    subprocess.run([sys.executable, "-m", "mrl.quickstarts", "moe", "--out", str(assets), "--warm-start-steps", "0"],
                   cwd=ROOT, check=True, capture_output=True, timeout=900)
    cmd = [sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart_moe.yaml",
           f"model.path={assets}/tiny-qwen3-moe", f"data.train_files=[{assets}/data/train.jsonl]",
           f"data.val_files=[{assets}/data/val.jsonl]", f"trainer.mlflow_tracking_uri=sqlite:///{mlflow_db(tmp_path / 'mlflow.db')}",
           f"rollout.port_base={free_port_pair()}", "trainer.total_training_steps=2", "trainer.test_freq=-1",
           "trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path}/ckpt",
           # one mini-batch per step: every forward runs the weights the engines sampled with, so the trainer's
           # own routing must be the engine's (a second mini-batch would run after an optimizer step)
           "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4"]
    env = train_env(cmd)  # on the session's Ray instance
    p = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    diff = metrics(db, "training/rollout_probs_diff_max")
    assert sorted(diff) == [1, 2] and all(v < 1e-5 for v in diff.values()), diff  # step 2: after a weight sync
    mismatch = metrics(db, "moe/replay_mismatch")
    # the trainer's own routing is the engine's (same weights, fp32 both sides): not one token differs
    assert sorted(mismatch) == [1, 2] and all(v == 0.0 for v in mismatch.values()), mismatch
    assert all(v > 0 for v in metrics(db, "moe/aux_loss").values())
    assert all(0 < v <= 1 for v in metrics(db, "moe/load_entropy").values())


def test_engines_return_routed_experts_when_replay_is_on(tmp_path: Path) -> None:
    cfg = load_config("mrl_configs/qwen3-30b-a3b_grpo_1x8_ep8.yaml")
    cmd, _ = engine_command(cfg, plan_engines(cfg, _gpu_infos(), 2)[1], token=None, dtype="bfloat16")
    assert "--enable-return-routed-experts" in cmd and cmd[cmd.index("--tp-size") + 1] == "4"
    off = load_config("mrl_configs/qwen3-30b-a3b_grpo_1x8_ep8.yaml", ["actor.moe.routing_replay=none"])
    assert "--enable-return-routed-experts" not in engine_command(off, plan_engines(off, _gpu_infos(), 2)[1], None, dtype="bfloat16")[0]
    (tmp_path / "m").mkdir()
    cpu = load_config("mrl_configs/quickstart_moe.yaml", [f"model.path={tmp_path}/m"])
    cmd, _ = engine_command(cpu, plan_engines(cpu, [_node("a", "127.0.0.1", [])] * 2, 2)[0], token=None, dtype="float32")
    assert cmd[1:3] == ["-m", "mrl.rollout.engine.server"] and "--enable-return-routed-experts" in cmd
