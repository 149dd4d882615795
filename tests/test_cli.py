"""`mrl` CLI: exit codes (0 valid, 2 config errors, 3 training not in this build), dry-run, engine dispatch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mrl.cli import EXIT_CONFIG, EXIT_UNSUPPORTED, main

REPO = Path(__file__).resolve().parents[1]
QUICK = str(REPO / "mrl_configs" / "quickstart.yaml")


def test_plan_valid_prints_config_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", QUICK, "actor.optim.lr=2e-5"]) == 0
    out = capsys.readouterr().out
    assert "# resolved config" in out and "lr: 2.0e-05" in out
    assert "samples per step: 512" in out and "micro-batches per actor DP rank per mini-batch: 4" in out


def test_plan_invalid_exits_2_with_every_error(capsys: pytest.CaptureFixture[str]) -> None:
    # an unknown key does not hide the cross-field problems: all come back in one run
    rc = main(["plan", QUICK, "rollout.n=1", "actor.optim.lrr=1", "actor.ppo_micro_batch_size_per_gpu=2",
               "rollout.temperature=0"])
    err = capsys.readouterr().err
    assert rc == EXIT_CONFIG == 2
    assert "3 config error(s)" in err
    assert "'actor.optim.lrr'" in err and "rollout.n=1" in err and "rollout.temperature=0.0" in err


def test_missing_config_file_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "no/such.yaml"]) == 2
    assert "config file 'no/such.yaml' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["train", QUICK, "--dry-run"], ["train", "--dry-run", QUICK, "rollout.n=8"],
                                  ["train", QUICK, "--dry-run", "rollout.n=8"]])
def test_train_dry_run_stops_after_plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    assert "plan:" in capsys.readouterr().out


def test_train_refuses_a_layout_the_critic_cannot_share_at_config_time(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Refused when the config loads, like every rule (exit 2), before Ray or any engine starts.
    argv = ["train", QUICK, "critic.enable=true", "critic.ppo_micro_batch_size_per_gpu=4",
            "critic.megatron.pipeline_model_parallel_size=2", "model.path=/nonexistent/model"]
    assert main(argv) == EXIT_CONFIG == 2
    err = capsys.readouterr().err
    assert "critic.megatron.pipeline_model_parallel_size=2" in err and "fix:" in err


def test_train_refuses_missing_files_before_starting_anything(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = tmp_path / "t.jsonl"  # the prompt files exist (a missing one is a data error, exit 2: tests/config/test_data_files.py)
    data.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n' * 32)
    argv = ["train", QUICK, "model.path=/nonexistent/model", f"data.train_files=[{data}]", f"data.val_files=[{data}]"]
    assert main(argv) == EXIT_UNSUPPORTED == 3
    assert "model.path='/nonexistent/model' does not exist" in capsys.readouterr().err


def test_engine_dispatches_to_rollout_server(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["engine", "--help"])
    assert ei.value.code == 0
    assert "--model" in capsys.readouterr().out


def test_python_dash_m_mrl() -> None:
    out = subprocess.run([sys.executable, "-m", "mrl", "plan", QUICK, "bad.key=1"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "unknown key 'bad'" in out.stderr
