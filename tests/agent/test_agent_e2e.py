"""`mrl train mrl_configs/quickstart_agent.yaml` end to end on CPU, 2 steps: multi-turn tool-calling
rollouts through the real driver (Ray ranks with Megatron, two embedded engines, tensor weight sync),
agent metrics logged, and the Megatron actor's probabilities of the sampled tokens equal to the
engines' across turns (tool tokens masked out)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import (
    ROOT,
    free_port_pair,
    metrics,
    mlflow_db,
    train_env,
    write_agent_assets,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the warm start is CPU-bound: slow on a loaded host


def test_agent_quickstart_trains_two_steps(tmp_path: Path) -> None:
    from mrl.quickstarts.agent import MODEL_DIR

    write_agent_assets(tmp_path / "assets")  # warm-started for the call format (pipeline test, not learning)
    a, port = tmp_path / "assets", free_port_pair()
    cmd = [sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart_agent.yaml", f"model.path={a}/{MODEL_DIR}",
           f"data.train_files=[{a}/data/train.jsonl]", f"data.val_files=[{a}/data/val.jsonl]",
           f"trainer.mlflow_tracking_uri=sqlite:///{mlflow_db(tmp_path / 'mlflow.db')}", f"rollout.port_base={port}",
           "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.val_before_train=false",
           "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
           f"trainer.rollout_data_dir={tmp_path}/rollouts", f"trainer.default_local_dir={tmp_path}/checkpoints"]
    env = train_env(cmd)  # on the session's Ray instance
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    db = tmp_path / "mlflow.db"
    turns = metrics(db, "agent/turns/mean")
    assert sorted(turns) == [1, 2] and all(1.0 <= v <= 2.0 for v in turns.values())
    assert max(metrics(db, "agent/tool_calls/mean").values()) > 0  # some samples called the calculator
    assert sorted(metrics(db, "agent/tool_errors")) == [1, 2] and sorted(metrics(db, "agent/tool_timeouts")) == [1, 2]
    # |p_actor - p_engine| over the engine-sampled tokens of every turn (tool tokens masked out): Megatron
    # vs the engine's transformers forward, fp32, contexts up to ~100 tokens: 7e-6 to 1.2e-5 measured on
    # the demo (the 1e-5 log-prob check against transformers is tests/agent/test_loop.py)
    diff = metrics(db, "training/rollout_probs_diff_max")
    assert sorted(diff) == [1, 2] and all(v < 5e-5 for v in diff.values()), diff
    assert all(v < 1e-6 for v in metrics(db, "training/rollout_probs_diff_mean").values())
    # response_length counts the model's own tokens: at most the budget, tool tokens excluded
    assert all(v <= 64 for v in metrics(db, "response_length/max").values())
    assert sorted(metrics(db, "val-core/agent_arith/acc/mean_at_2")) == [2]
    dump = (tmp_path / "rollouts" / "1.jsonl").read_text()
    assert "<tool_call>" in dump and "tool:" in dump  # the scorer saw the whole trajectory
