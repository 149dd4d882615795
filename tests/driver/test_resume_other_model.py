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
