"""`mrl plan` must stay light: no torch/Ray/Megatron/SGLang/transformers at config-load time, < 3 s."""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "megatron", "sglang", "transformers", "mlflow", "fastapi")

_PROBE = f"""
import sys
from mrl.cli import main
rc = main(["plan", "mrl_configs/quickstart.yaml", "rollout.n=8", *sys.argv[1:]])
heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))
print("HEAVY", heavy, "RC", rc)
"""


@pytest.mark.parametrize("model", ["as_configured", "tiny_checkpoint"])
def test_plan_imports_no_heavy_stack_and_is_fast(model: str, tmp_path: Path) -> None:
    # as_configured: outputs/quickstart/tiny-qwen2, absent on a clean clone (present after `make train`);
    # tiny_checkpoint: a real checkpoint directory, so plan also reads its config, weight headers and tokenizer
    # files (the architecture check once imported the provider, and torch with it, only on this path)
    args = []
    if model == "tiny_checkpoint":
        from tests.helpers.tiny_models import make_tiny_hf

        args = [f"model.path={make_tiny_hf(tmp_path / 'm')}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out.returncode == 0, out.stderr
    assert "HEAVY [] RC 0" in out.stdout, out.stdout[-500:]
    # CPU time rather than wall time: the shared CI CPU may be oversubscribed.
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu_s < 3.0, f"mrl plan used {cpu_s:.2f} s of CPU"
