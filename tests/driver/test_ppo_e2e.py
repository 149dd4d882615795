"""`mrl train mrl_configs/quickstart_ppo.yaml` end to end on CPU: PPO with a colocated critic.

Step 1 is a critic-only warm-up step (trainer.critic_warmup=1) and is checkpointed; a second run
resumes from it for step 2, where the actor starts. Real components throughout: Ray rank actors
with Megatron GPTModel actor + value model (gloo, DP=2), two embedded engine processes, tensor
weight sync (checksums verified) into engines that release their memory after each generation and
get it back around the sync (rollout.free_cache_engine), the arith scorer and an MLflow sqlite store. Tiny sizes keep it near 150 s idle.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers.e2e import free_port_pair, metrics, run_train, write_assets

pytestmark = pytest.mark.slow

CRITIC_KEYS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
               *(f"critic/{s}/{a}" for s in ("values", "returns") for a in ("mean", "max", "min")),
               "timing_s/values", "timing_s/update_critic"]


def _train(tmp: Path, assets: Path, steps: int, port: int):
    return run_train("mrl_configs/quickstart_ppo.yaml", tmp, assets, port, "data.val_files=[]",
                     "data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
                     "critic.ppo_micro_batch_size_per_gpu=2", "rollout.max_response_length=16",
                     f"trainer.total_training_steps={steps}", "trainer.critic_warmup=1", "trainer.save_freq=1",
                     f"trainer.default_local_dir={tmp}/ckpt",
                     # engines release their memory after generating and get it back around the sync
                     "rollout.free_cache_engine=true", "rollout.weight_sync.verify=true")


def _common(ckpt: Path) -> dict:
    """The non-sharded part of a dist_checkpointing save: mrl_extra, LR-scheduler state."""
    return torch.load(ckpt / "common.pt", weights_only=False)


def test_ppo_critic_warmup_checkpoint_and_resume(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    port = free_port_pair()
    p = _train(tmp_path, assets, 1, port)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    ckpt = tmp_path / "ckpt"
    s1 = ckpt / "global_step_1"
    assert (s1 / "critic" / "metadata.json").is_file() and (s1 / "actor" / "metadata.json").is_file()
    c1 = _common(s1 / "critic")
    # 8 samples / (2 prompts x n=2 per mini-batch) = 2 critic optimizer steps in step 1
    assert c1["mrl_extra"]["global_step"] == 1 and c1["opt_param_scheduler"]["num_steps"] == 2

    p = _train(tmp_path, assets, 2, port)  # resume_mode=auto picks up global_step_1
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    for key in CRITIC_KEYS:
        got = metrics(db, key)
        assert sorted(got) == [1, 2] and all(math.isfinite(v) for v in got.values()), (key, got)
    assert metrics(db, "critic/vf_loss")[1] > 0
    # warm-up: step 1 trained only the critic and pushed nothing; the actor starts at step 2
    assert sorted(metrics(db, "actor/pg_loss")) == [2]
    assert metrics(db, "rollout/weight_version") == {1: 0.0, 2: 2.0}
    assert metrics(db, "rollout/engine_weight_version") == {1: 0.0, 2: 0.0}
    assert sorted(metrics(db, "timing_s/engine_sleep")) == [1, 2]
    # the resumed critic continued from the saved one: its step counter and LR schedule carry on
    # (a fresh critic would save global_step 1 / num_steps 2 again)
    c2 = _common(ckpt / "global_step_2" / "critic")
    assert c2["mrl_extra"]["global_step"] == 2 and c2["opt_param_scheduler"]["num_steps"] == 4
    assert _common(ckpt / "global_step_2" / "actor")["opt_param_scheduler"]["num_steps"] == 2
    state = json.loads((ckpt / "global_step_2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["weight_version"] == 2
