"""benchmarks/gpu_bench.py cannot rot between the rare GPU hosts: its ``--cpu-smoke`` mode runs every
section (actor forward+backward per attention variant, weight sync into the engine, the long-context variants and
the longest-sequence search with its out-of-memory path simulated, engine vs transformers decode, one MoE layer, the
Qwen3.5 hybrid's update and longest sequence) at a tiny size on CPU in a subprocess, and without ``--cpu-smoke`` on a host with no GPU it says so and exits 0."""
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
    _check_hybrid(out["qwen35_hybrid"])
    cp = out["context_parallel"]  # 2 gloo ranks on CPU: the code runs, nothing is measured
    assert cp["tokens"] == 64 and list(cp["by_cp"]) == ["1", "2"] and "not_measured" not in cp
    for r in cp["by_cp"].values():
        assert r["seconds"] > 0 and r["peak_gib_per_device"] is None and r["peak_ratio_vs_cp1"] is None
    # the same update at both sizes (fp32, one 64-token sequence: the CP tests' 1e-5)
    assert cp["by_cp"]["2"]["loss"] == pytest.approx(cp["by_cp"]["1"]["loss"], rel=1e-5)
    assert json.loads((tmp_path / "o" / "gpu_bench.json").read_text()) == out
    for text in ("gpu_bench summary", "sdpa+packed", "goal >= 32768: not met", "levers", "simulated", "qwen35_hybrid",
                 "context_parallel: one sequence of 64 tokens"):
        assert text in table


def _reference_flops(shape: dict, layer_types: list[str], tokens: int, seq: int) -> int:
    """The hybrid's count with N taken from the real transformers model (every nn.Linear weight, LM head included,
    and the depthwise conv1d's K weights per channel), not from the script's own sum; the s-terms as the script's
    docstring states them: 12·L_full·n_h·d_h·s per token for the full-attention layers only, and the chunked delta
    rule's 3·n_v·(4·C·d_k + 3·C·d_v + 6·d_k·d_v) per token for each linear-attention layer (C = 64)."""
    import torch
    import transformers as tf

    with torch.device("meta"):
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**shape))
    assert model.config.layer_types == layer_types
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d)))
    n_full = layer_types.count("full_attention")
    dk, dv, C = shape["linear_key_head_dim"], shape["linear_value_head_dim"], 64
    per_token = (6 * n + 12 * n_full * shape["num_attention_heads"] * shape["head_dim"] * seq
                 + 3 * (len(layer_types) - n_full) * shape["linear_num_value_heads"] * (4 * C * dk + 3 * C * dv + 6 * dk * dv))
    return per_token * tokens


def _check_hybrid(h: dict) -> None:
    """The Qwen3.5 section: a text-only Qwen3_5ForCausalLM of 3 linear + 1 full layer, its packed sdpa update timed
    with the hybrid's FLOP count, mrl's torch delta rule (no fla here), the longest-sequence search with recompute."""
    assert h["architectures"] == ["Qwen3_5ForCausalLM"]
    assert h["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert h["shape"]["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert h["delta_rule_kernel"].startswith("mrl torch chunked")
    u = h["update"]
    assert u["tokens"] == 48 and u["seq_len"] == 12 and list(u["by_variant"]) == ["sdpa+packed"]
    assert u["flops_per_minibatch"] == _reference_flops(h["shape"], h["layer_types"], 48, 12)
    r = u["by_variant"]["sdpa+packed"]
    assert r["built"]["core_attention"] == ["SDPAAttention"] and r["built"]["remove_padding"] is True
    assert r["seconds_per_minibatch"] > 0 and r["tflops"] > 0 and r["mfu"] is None
    lo = h["longest"]
    assert lo["built"]["recompute_granularity"] == "full" and lo["rows"].startswith("packed") and lo["longest"] == 64
    assert [n for n, x in lo["by_length"].items() if x["fits"]] == ["16", "32", "64"]
    assert lo["by_length"]["128"]["oom"] and "simulated" in lo["by_length"]["128"]["error"]


def test_without_a_gpu_it_says_so() -> None:
    out, _ = _run()
    assert "no CUDA device visible" in out["skipped"] and "--cpu-smoke" in out["skipped"]


def test_one_backend_profile_and_only(tmp_path) -> None:
    out, _ = _run("--cpu-smoke", "--profile", "--only", "actor_fwd_bwd", "--attention-backend", "local")
    assert out["errors"] == {} and set(out) >= {"actor_fwd_bwd", "actor_profile"}
    assert not {"engine_decode", "weight_sync", "moe_layer", "long_context", "qwen35_hybrid"} & set(out)
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
