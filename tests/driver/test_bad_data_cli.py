"""`mrl train` on a prompt file with a bad row: exit code 2 and file:row:column, before Ray starts
(issue 19: these surfaced as tracebacks 16-32 s in, after Ray and Megatron had started)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny_models import make_tiny_hf

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("rows, must", [
    # 8 rows each (data.train_batch_size=8: fewer is refused by the row count first, tests/config/test_data_files.py)
    ([{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}, {"prompt": 7, "reward_model": {"ground_truth": "2"}}]
     + [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}] * 6, ["t.jsonl:2", "'prompt'", "int"]),
    ([{"prompt": "1+1=", "reward_model": {"ground_truth": ["2"]}}] + [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}] * 7,
     ["t.jsonl:1", "reward_model.ground_truth", "list"]),
    ([{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}] * 3,
     ["data.train_batch_size=8", "exceeds the 3 rows"]),
])
def test_bad_rows_exit_2_before_ray(tmp_path: Path, rows: list[dict], must: list[str]) -> None:
    model = tmp_path / "m"
    make_tiny_hf(model)  # a whole checkpoint: mrl train's preflight reads the weights' headers and the tokenizer
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "MLFLOW_DISABLE_TELEMETRY": "true"}
    p = subprocess.run([sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart.yaml", f"model.path={model}",
                        f"data.train_files=[{data}]", "data.val_files=[]", "trainer.val_before_train=false",
                        "trainer.test_freq=-1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
                        f"trainer.default_local_dir={tmp_path}/ckpt"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    assert all(s in p.stderr for s in must), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Ray" not in p.stderr, p.stderr[-3000:]


def test_malicious_checkpoint_is_refused_in_the_driver_before_ray(tmp_path: Path) -> None:
    # issue 19: a crafted .metadata ran code in both rank processes on `mrl train trainer.resume_mode=<dir>`
    # a refused resume is a user mistake: exit 2, as a config error (issue 33)
    from tests.megatron.test_safe_metadata import _fake_mrl_checkpoint

    model = tmp_path / "m"
    make_tiny_hf(model)  # a whole checkpoint: mrl train's preflight reads the weights' headers and the tokenizer
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}) + "\n")
    step = tmp_path / "ckpt" / "global_step_1"
    marker = tmp_path / "pwned"
    _fake_mrl_checkpoint(step / "actor", marker)
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for mode in (str(step), "auto"):
        p = subprocess.run([sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart.yaml", f"model.path={model}",
                            f"data.train_files=[{data}]", "data.val_files=[]", "trainer.val_before_train=false",
                            "trainer.test_freq=-1", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1",
                            "actor.ppo_micro_batch_size_per_gpu=4", f"trainer.default_local_dir={tmp_path}/ckpt",
                            f"trainer.resume_mode={mode}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
        assert "refusing the tensor index" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
        assert not marker.exists()
