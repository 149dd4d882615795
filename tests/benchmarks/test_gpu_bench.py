"""benchmarks/gpu_bench.py cannot rot between the rare GPU hosts: its ``--cpu-smoke`` mode runs every
section (actor forward+backward per attention variant, weight sync into the engine, the long-context variants and
the longest-sequence search with its out-of-memory path simulated, engine vs transformers decode, one MoE layer) at a
tiny size on CPU in a subprocess, and without ``--cpu-smoke`` on a host with no GPU it says so and exits 0."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_bench.py"
pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    p = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, env=env, timeout=280,
                       cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out, end = json.JSONDecoder().raw_decode(p.stdout, p.stdout.index("{"))
    return out, p.stdout[end:]


def test_cpu_smoke_runs_every_section(tmp_path) -> None:
    out, table = _run("--cpu-smoke", "--out-dir", str(tmp_path / "o"))
    assert out["mode"] == "cpu-smoke" and out["errors"] == {} and out["skipped"] == []
    assert out["attention_backends"] == ["local", "sdpa"] and out["variants"] == ["local", "sdpa", "sdpa+packed"]
    a = out["actor_fwd_bwd"]
    assert a["tokens"] == 48 and a["micro_batch"] == 2
    core = {"local": ["DotProductAttention"], "sdpa": ["SDPAAttention"], "sdpa+packed": ["SDPAAttention"]}
    for label, r in a["by_variant"].items():  # each variant built what it says, and was timed
        assert r["built"]["core_attention"] == core[label] and r["built"]["remove_padding"] == label.endswith("packed")
        assert r["seconds_per_minibatch"] > 0 and r["mfu"] is None and r["pad_fraction"] == 0  # no peak on CPU
    assert a["by_variant"]["local"]["speedup_vs_local"] == 1.0
    lc = out["long_context"]
    assert lc["mfu"]["tokens"] == 4 * 32 and set(lc["mfu"]["by_variant"]) == set(core)
    lo = lc["longest"]
    for k, rec in (("no_recompute", None), ("with_recompute", "full")):
        r = lo[k]
        assert r["built"]["recompute_granularity"] == rec and r["longest"] == 64  # the simulated OOM above 64
        assert [n for n, x in r["by_length"].items() if x["fits"]] == ["16", "32", "64"]
        assert r["by_length"]["128"]["oom"] and "simulated" in r["by_length"]["128"]["error"]
    assert lo["with_recompute"]["config"] == {"recompute_granularity": "full", "recompute_method": "uniform",
                                              "recompute_num_layers": 1}
    lev = out["levers"]
    assert lev[0]["actor_fwd_bwd"] > 0 and lev[1]["long_context"] > 0 and lev[2]["with"] == 64
    assert "not_measured" in lev[3]
    for b in ("4", "8"):
        d = out["engine_decode"]["by_batch"][b]
        assert d["mrl_tokens"] == d["hf_tokens"] == int(b) * 4 and d["ratio"] > 0
    s = out["weight_sync"]
    assert s["bytes"] > 0 and s["gb_s"] > 0 and s["ratio_to_d2d"] > 0
    m = out["moe_layer"]
    assert m["tokens"] == 32 and m["experts"] == 8 and m["tokens_per_s"] > 0
    assert json.loads((tmp_path / "o" / "gpu_bench.json").read_text()) == out
    for text in ("gpu_bench summary", "sdpa+packed", "goal >= 32768: not met", "levers", "simulated"):
        assert text in table


def test_without_a_gpu_it_says_so() -> None:
    out, _ = _run()
    assert "no CUDA device visible" in out["skipped"] and "--cpu-smoke" in out["skipped"]


def test_one_backend_profile_and_only(tmp_path) -> None:
    out, _ = _run("--cpu-smoke", "--profile", "--only", "actor_fwd_bwd", "--attention-backend", "local")
    assert out["errors"] == {} and set(out) >= {"actor_fwd_bwd", "actor_profile"}
    assert not {"engine_decode", "weight_sync", "moe_layer", "long_context"} & set(out)
    assert list(out["actor_fwd_bwd"]["by_variant"]) == list(out["actor_profile"]) == ["local"]
    for p in out["actor_profile"].values():
        assert p["wall_s"] > 0 and 0 < p["kernel_s"] and p["top"] and all(len(r) == 3 for r in p["top"])


def test_te_only_where_it_imports() -> None:
    spec = importlib.util.spec_from_file_location("gpu_bench_under_test", SCRIPT)
    gb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gb)
    assert gb.backends_for("all") == ["local", "sdpa"]  # no Transformer Engine on CUDA here
    with pytest.raises(ValueError, match="Transformer Engine is not importable"):
        gb.backends_for("te")
    assert gb.variants_for(["local"]) == [("local", "local", False)]
    assert gb.variants_for(["sdpa"]) == [("sdpa", "sdpa", False), ("sdpa+packed", "sdpa", True)]
