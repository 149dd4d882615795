"""benchmarks/gpu_bench.py cannot rot between the rare GPU hosts: its ``--cpu-smoke`` mode runs every
section (actor forward+backward, engine vs transformers decode, weight sync into the engine, one MoE layer) at a tiny
size on CPU in a subprocess, and without ``--cpu-smoke`` on a host with no GPU it says so and exits 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_bench.py"
pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, env=env, timeout=280,
                       cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout[p.stdout.index("{"):])


def test_cpu_smoke_runs_every_section(tmp_path) -> None:
    out = _run("--cpu-smoke", "--json", str(tmp_path / "r.json"))
    assert out["mode"] == "cpu-smoke" and out["errors"] == {} and out["skipped"] == []
    a = out["actor_fwd_bwd"]
    assert a["tokens"] == 48 and a["seconds_per_minibatch"] > 0 and a["mfu"] is None  # no peak on CPU
    for b in ("4", "8"):
        d = out["engine_decode"]["by_batch"][b]
        assert d["mrl_tokens"] == d["hf_tokens"] == int(b) * 4 and d["ratio"] > 0
    s = out["weight_sync"]
    assert s["bytes"] > 0 and s["gb_s"] > 0 and s["ratio_to_d2d"] > 0
    m = out["moe_layer"]
    assert m["tokens"] == 32 and m["experts"] == 8 and m["tokens_per_s"] > 0
    assert json.loads((tmp_path / "r.json").read_text()) == out


def test_without_a_gpu_it_says_so() -> None:
    out = _run()
    assert "no CUDA device visible" in out["skipped"] and "--cpu-smoke" in out["skipped"]


def test_profile_and_only_select_sections(tmp_path) -> None:
    out = _run("--cpu-smoke", "--profile", "--only", "actor_fwd_bwd")
    assert out["errors"] == {} and set(out) >= {"actor_fwd_bwd", "actor_profile"}
    assert not {"engine_decode", "weight_sync", "moe_layer"} & set(out)
    p = out["actor_profile"]
    assert p["wall_s"] > 0 and 0 < p["kernel_s"] and p["top"] and all(len(r) == 3 for r in p["top"])
