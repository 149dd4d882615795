"""A resume against another base model is refused before Ray, naming what differs: the shape (from the
checkpoint's recorded config) or, for the same shapes, the weights (the base-model fingerprint every
checkpoint's trainer_state.json records)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mrl.config import load_config
from mrl.driver.base_model import fingerprint, mismatch, record
from mrl.driver.build import _check_resume_dir
from mrl.errors import UnsupportedConfigError
from tests.helpers.tiny_models import make_tiny_hf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {"a": make_tiny_hf(root / "a", "qwen2", seed=0), "b": make_tiny_hf(root / "b", "qwen2", seed=1),
            "c": make_tiny_hf(root / "c", "qwen2", seed=0, num_hidden_layers=2)}


def test_fingerprint_tells_other_weights_apart(models: dict[str, Path]) -> None:
    a = json.loads((models["a"] / "config.json").read_text())
    assert fingerprint(str(models["a"])) == fingerprint(str(models["a"]))
    assert mismatch(str(models["a"]), a, record(str(models["a"]))) is None
    assert "other weights" in mismatch(str(models["b"]), a, record(str(models["a"])))
    assert "num_hidden_layers: checkpoint 4, model.path 2" in mismatch(str(models["c"]), a, record(str(models["a"])))


def _checkpoint_of(model: Path, root: Path) -> Path:
    """``root/ckpt/global_step_1`` holding ``model`` converted, as a run's first checkpoint."""
    step = root / "ckpt" / "global_step_1"
    p = subprocess.run([sys.executable, "-m", "checkpoints_tools.cli", "hf-to-mcore", "--hf", str(model),
                        "--out", str(step / "actor"), "--device", "cpu", "--timeout", "240"], cwd=ROOT,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 1, "base_model": record(str(model))}))
    return step


def test_mrl_train_refusals_of_a_resume_exit_2_without_a_traceback(models: dict[str, Path], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Every refused resume is a user mistake and exits 2 like a config error (mrl/cli.py's exit codes):
    another model, a corrupt common.pt (named with its role), a resume path that is not a checkpoint."""
    from mrl.cli import main

    step = _checkpoint_of(models["a"], tmp_path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question: what is {i} + 1 ? answer:",
                                        "reward_model": {"ground_truth": str(i + 1)}}) + "\n" for i in range(40)))

    def train(model: str, *more: str) -> tuple[int, str]:
        rc = main(["train", "mrl_configs/quickstart.yaml", f"model.path={models[model]}", f"data.train_files=[{data}]",
                   "data.val_files=[]", "trainer.test_freq=-1", "trainer.val_before_train=false",
                   f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.logger=[console]", *more])
        return rc, capsys.readouterr().err

    for other, needle in (("b", "holds other weights"), ("c", "another shape")):
        rc, err = train(other)
        assert rc == 2 and needle in err and "nothing was started" in err and "Traceback" not in err, err
    common = step / "actor" / "common.pt"
    for damage in (common.read_bytes()[:40], b"\xff" * 64, b"\0" * 64):
        saved = common.read_bytes()
        common.write_bytes(damage)
        rc, err = train("a")
        common.write_bytes(saved)
        assert rc == 2 and f"{common} (Megatron's common (non-tensor) state" in err and "Traceback" not in err, err
    for resume in (tmp_path / "nowhere", tmp_path / "ckpt"):  # absent; there but not a global_step_<N>
        rc, err = train("a", f"trainer.resume_mode={resume}")
        assert rc == 2 and "Traceback" not in err and "nothing was started" in err, err


def test_the_driver_refuses_the_resume_before_ray(models: dict[str, Path], tmp_path: Path) -> None:
    step = tmp_path / "ckpt" / "global_step_1"
    p = subprocess.run([sys.executable, "-m", "checkpoints_tools.cli", "hf-to-mcore", "--hf", str(models["a"]),
                        "--out", str(step / "actor"), "--device", "cpu", "--timeout", "240"], cwd=ROOT,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"), capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 1, "base_model": record(str(models["a"]))}))

    def cfg(model: Path):
        return load_config("mrl_configs/quickstart.yaml", [f"model.path={model}", f"trainer.default_local_dir={tmp_path}/ckpt",
                                                           "trainer.resume_mode=auto"], check=False)

    assert _check_resume_dir(cfg(models["a"])) == step
    for other, needle in (("b", "holds other weights"), ("c", "another shape")):
        with pytest.raises(UnsupportedConfigError, match=needle) as e:
            _check_resume_dir(cfg(models[other]))
        assert "fix:" in str(e.value)
