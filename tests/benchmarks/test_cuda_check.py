"""benchmarks/cuda_check.py's attention block (``--only attention``: sdpa forward+backward vs the local backend,
packed rows vs padded rows) runs on CPU/gloo with ``--allow-cpu``, so the rows the next GPU lease reads cannot rot;
on CPU the packed rows take the per-sequence SDPA path (varlen_attn is CUDA + bf16/fp16 only), which the row says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "cuda_check.py"
pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, env=env,
                          timeout=280, cwd=REPO)


def test_attention_block_on_cpu(tmp_path) -> None:
    p = _run("--allow-cpu", "--only", "attention", "--dtypes", "float32", "--json", str(tmp_path / "c.json"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [(r["check"], r["status"]) for r in rows] == [
        ("attention: sdpa forward+backward = local backend", "PASS"),
        ("attention: packed rows (varlen_attn) = padded rows", "PASS")]
    sdpa, packed = rows
    assert sdpa["value"] <= 1e-4 and "SDPAAttention vs DotProductAttention" in sdpa["detail"]
    assert packed["value"] <= 1e-4 and "pad fraction packed 0 vs padded 0.143" in packed["detail"]
    assert "per-sequence SDPA" in packed["detail"] and "PASS 2" in p.stdout


def test_without_a_gpu_it_says_so() -> None:
    p = _run("--only", "attention")
    assert p.returncode == 0 and "cuda_check: SKIP - no CUDA device visible" in p.stdout
