"""GPU evidence in one command (one GPU, <= 8 minutes, no network): prints one JSON object.

    python benchmarks/gpu_bench.py                 # on a CUDA host (docs/gpu.md: what it needs there)
    python benchmarks/gpu_bench.py --cpu-smoke     # the same code at a tiny size on CPU (a test runs it)

What it measures, in one process (torch.distributed world size 1, Megatron TP = PP = 1, local layer spec):

  actor_fwd_bwd   mrl's Megatron actor (``ActorWorker.forward_backward``: the update's forward and backward,
                  no optimizer step) at a Qwen2.5-1.5B shape with random weights, bf16: seconds per
                  mini-batch, model TFLOP/s and MFU = achieved / the GPU's dense bf16 peak.
                  FLOPs = 6·N·T + 12·L·h·s·T (N = matmul weights incl. the LM head, T tokens, L layers,
                  h hidden, s sequence length: Megatron's count, attention not halved for causality)
  engine_decode   the embedded engine (mrl/rollout/engine, over its HTTP API as the trainer uses it) vs
                  ``transformers.generate`` (sampling, same model, same dtype): generated tokens/s at
                  batch 64 and 256, fixed prompt and output lengths (ignore_eos / min_new_tokens)
  weight_sync     the actor's HF-named export copied into the engine (``InProcessEngine.load_weights``,
                  what transport=inprocess does), GB/s, and its ratio to a plain device-to-device copy of
                  the same number of bytes (torch ``copy_`` of one flat buffer)

  moe_layer       one Mixture-of-Experts decoder layer (Megatron's MoE layer as mrl builds it: SequentialMLP
                  experts on the local spec, all-to-all dispatcher, EP = 1) at a Qwen3-30B-A3B layer shape
                  (hidden 2048, 128 experts of width 768, top-8) in bf16: forward+backward tokens/s and
                  TFLOP/s of the active weights (6·N_active·T, attention's s-term left out)

Each section catches its own failure (``errors`` in the JSON) so one broken part does not hide the
others; a section is skipped once the time budget (``--budget-s``) is spent. Without a CUDA device it
prints {"skipped": ...} and exits 0 unless ``--cpu-smoke`` is given.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# Qwen2.5-1.5B's shape (its config.json), random weights
QWEN25_15B = {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
              "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 4096,
              "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True, "rms_norm_eps": 1e-6}
# dense bf16 peak, TFLOP/s (NVIDIA datasheets, SXM)
PEAK_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}

# One Qwen3-30B-A3B decoder layer (its config.json: mrl/config/hub_shapes/), a small vocabulary (the layer is measured)
QWEN3_MOE_LAYER = {"vocab_size": 1024, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 1,
                   "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096,
                   "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                   "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
TINY_MOE = {**{k: v for k, v in QWEN3_MOE_LAYER.items() if k not in ("hidden_size", "head_dim", "num_experts",
                                                                      "moe_intermediate_size")},
            "hidden_size": 64, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

SIZES = {  # mode: model shape, update batch (samples, prompt, response), decode (batches, prompt, new), timed iters
    "gpu": {"shape": QWEN25_15B, "dtype": "bfloat16", "update": (8, 512, 512), "micro": 2,
            "decode": ((64, 256), 32, 128), "iters": 3, "moe": (QWEN3_MOE_LAYER, 4, 2048)},
    "cpu-smoke": {"shape": TINY, "dtype": "float32", "update": (4, 6, 6), "micro": 2, "decode": ((4, 8), 4, 4),
                  "iters": 1, "moe": (TINY_MOE, 2, 16)},
}


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def matmul_params(c: dict) -> int:
    """Weights that enter a matmul per token: attention, MLP, and the LM head (tied or not)."""
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    qkv = h * (h + 2 * c["num_key_value_heads"] * hd)
    return L * (qkv + h * h + 3 * h * i) + c["vocab_size"] * h


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def write_model(shape: dict, dtype: str, device: str, path: pathlib.Path) -> str:
    """A random Qwen2 checkpoint of ``shape`` (built on the device: fast init), saved for both sides to load."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(tf.Qwen2Config(**shape), dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    from tests.helpers.tiny_tokenizer import (
        save_tiny_tokenizer,  # the engine's HTTP layer loads a tokenizer
    )

    save_tiny_tokenizer(path)
    del model
    return str(path)


def profiled(device: str, fn) -> dict:
    """One call of ``fn`` under torch.profiler: wall time, summed GPU kernel time (busy fraction) and the top
    kernels -- where a GPU step goes, for the next lever (``--profile``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    wall = time.perf_counter() - t0
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    evs = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    busy = sum(getattr(e, key) for e in evs) / 1e6
    top = sorted(evs, key=lambda e: getattr(e, key), reverse=True)[:15]
    return {"wall_s": round(wall, 4), "kernel_s": round(busy, 4), "busy_fraction": round(busy / wall, 3),
            "top": [[e.key[:90], e.count, round(getattr(e, key) / 1e3, 2)] for e in top]}  # name, calls, ms


def update_batch(B: int, P: int, R: int, vocab: int):
    import torch

    from mrl.workers.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P + R), generator=g)
    am = torch.ones_like(ids)
    pos = torch.arange(P + R).expand(B, -1).contiguous()
    mask = torch.ones(B, R, dtype=torch.long)
    return TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, P:].clone(),
                      response_mask=mask, old_log_probs=-torch.rand(B, R, generator=g),
                      advantages=torch.randn(B, R, generator=g), uid=torch.arange(B) // 2)


def bench_actor(out: dict, a, size: dict, model: str, device: str):
    import torch

    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker

    B, P, R = size["update"]
    t0 = time.perf_counter()
    actor = ActorWorker(ActorConfig(ppo_micro_batch_size_per_gpu=size["micro"]), model_path=model, device=device,
                        mini_batch_size_samples=B, seed=0, dtype=getattr(torch, size["dtype"]))
    build_s = time.perf_counter() - t0
    batch = update_batch(B, P, R, size["shape"]["vocab_size"])
    actor.forward_backward(batch)  # warm-up (allocator, kernels)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(size["iters"]):
        actor.forward_backward(batch)
    sync(device)
    s = (time.perf_counter() - t0) / size["iters"]
    if a.profile:
        out["actor_profile"] = profiled(device, lambda: actor.forward_backward(batch))
    c, T, seq = size["shape"], B * (P + R), P + R
    flops = 6 * matmul_params(c) * T + 12 * c["num_hidden_layers"] * c["hidden_size"] * seq * T
    peak = peak_tflops(out["device"]) if device == "cuda" else None
    out["actor_fwd_bwd"] = {
        "samples": B, "tokens": T, "seq_len": seq, "micro_batch": size["micro"], "dtype": size["dtype"],
        "build_s": round(build_s, 2), "seconds_per_minibatch": round(s, 4), "tflops": round(flops / s / 1e12, 6),
        "peak_tflops": peak, "mfu": round(flops / s / 1e12 / peak, 4) if peak else None}
    return actor


def bench_decode(out: dict, a, size: dict, model: str, device: str):
    import httpx
    import torch
    import transformers as tf
    from cuda_check import serve

    from mrl.rollout.engine.server import Engine

    batches, P, new = size["decode"]
    eng = Engine(model, device=device, dtype=size["dtype"], seed=0, max_running=max(batches))
    url, server = serve(eng)
    res: dict = {}
    try:
        for b in batches:
            prompts = [[3 + (i * 7 + j) % 250 for j in range(P)] for i in range(b)]
            body = {"input_ids": prompts, "sampling_params": [
                {"max_new_tokens": new, "temperature": 1.0, "ignore_eos": True, "sampling_seed": i} for i in range(b)]}
            httpx.post(f"{url}/generate", json={**body, "input_ids": prompts[:2], "sampling_params": body[
                "sampling_params"][:2]}, timeout=600, trust_env=False).raise_for_status()  # warm-up
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/generate", json=body, timeout=600, trust_env=False)
            r.raise_for_status()
            s = time.perf_counter() - t0
            n_tok = sum(len(o["output_ids"]) for o in r.json())
            res[str(b)] = {"mrl_tokens": n_tok, "mrl_s": round(s, 3), "mrl_tok_s": round(n_tok / s, 1)}
            if a.profile and b == min(batches):
                out["decode_profile"] = profiled(device, lambda body=body: httpx.post(
                    f"{url}/generate", json=body, timeout=600, trust_env=False).raise_for_status())
    finally:
        server.should_exit = True
    del eng
    if device == "cuda":
        torch.cuda.empty_cache()
    hf = tf.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, size["dtype"])).to(device).eval()
    for b in batches:
        ids = torch.tensor([[3 + (i * 7 + j) % 250 for j in range(P)] for i in range(b)], device=device)
        kw = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": new,
              "min_new_tokens": new, "pad_token_id": 0}
        with torch.no_grad():
            hf.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), **kw)  # warm-up
            sync(device)
            t0 = time.perf_counter()
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            sync(device)
        s = time.perf_counter() - t0
        n_tok = int((g.shape[1] - P) * b)
        res[str(b)] |= {"hf_tokens": n_tok, "hf_s": round(s, 3), "hf_tok_s": round(n_tok / s, 1),
                        "ratio": round(res[str(b)]["mrl_tok_s"] / (n_tok / s), 3)}
    out["engine_decode"] = {"prompt_tokens": P, "new_tokens": new, "dtype": size["dtype"], "by_batch": res}
    del hf


def bench_sync(out: dict, a, size: dict, model: str, device: str, actor):
    import types

    import torch
    from cuda_check import serve

    from mrl.rollout.engine.in_process import InProcessEngine
    from mrl.rollout.engine.server import Engine

    eng = Engine(model, device=device, dtype=size["dtype"], seed=0, max_running=8)
    url, server = serve(eng)
    try:
        named = list(actor.export_hf_weights())
        fake = types.SimpleNamespace(engine=eng, url=url)
        InProcessEngine.load_weights(fake, named, "1", verify=False, timeout_s=120)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        for i in range(size["iters"]):
            nbytes, nt = InProcessEngine.load_weights(fake, list(actor.export_hf_weights()), str(2 + i),
                                                      verify=False, timeout_s=120)
        sync(device)
        s = (time.perf_counter() - t0) / size["iters"]
    finally:
        server.should_exit = True
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(max(3, size["iters"])):
        dst.copy_(src)
    sync(device)
    d2d = (time.perf_counter() - t0) / max(3, size["iters"])
    out["weight_sync"] = {"path": "export_hf_weights -> InProcessEngine.load_weights (transport=inprocess)",
                          "tensors": nt, "bytes": nbytes, "seconds": round(s, 4), "gb_s": round(nbytes / s / 1e9, 2),
                          "d2d_copy_gb_s": round(nbytes / d2d / 1e9, 2), "ratio_to_d2d": round(d2d / s, 4)}


def bench_moe_layer(out: dict, a, size: dict, device: str):
    """One MoE decoder layer forward+backward (see the module docstring), built by mrl's provider."""
    import torch
    import transformers as tf

    from mrl.megatron.provider import build_model_chunks

    shape, b, s = size["moe"]
    cfg = tf.Qwen3MoeConfig(**shape, decoder_sparse_step=1, mlp_only_layers=[])
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    dtype = getattr(torch, size["dtype"])
    (model,) = build_model_chunks(cfg, dtype=dtype)
    model = model.to(device)
    layer = model.module.decoder.layers[0] if hasattr(model, "module") else model.decoder.layers[0]
    x = torch.randn(s, b, shape["hidden_size"], device=device, dtype=dtype, requires_grad=True)

    def step():
        y = layer(x)[0]
        y.float().pow(2).mean().backward()

    step()  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(size["iters"]):
        step()
    sync(device)
    sec = (time.perf_counter() - t0) / size["iters"]
    h, k, f = shape["hidden_size"], shape["num_experts_per_tok"], shape["moe_intermediate_size"]
    hd, nh, ng = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    active = h * hd * (nh + 2 * ng) + nh * hd * h + h * shape["num_experts"] + k * 3 * h * f
    T = b * s
    out["moe_layer"] = {"tokens": T, "experts": shape["num_experts"], "top_k": k, "dtype": size["dtype"],
                        "seconds_per_fwd_bwd": round(sec, 5), "tokens_per_s": round(T / sec, 1),
                        "tflops_active": round(6 * active * T / sec / 1e12, 6)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing")
    p.add_argument("--budget-s", type=float, default=420, help="skip the sections not started after this many seconds")
    p.add_argument("--json", help="also write the JSON here")
    p.add_argument("--profile", action="store_true", help="also profile one actor step and one decode request")
    p.add_argument("--only", help="comma-separated sections to run (actor_fwd_bwd, engine_decode, weight_sync, "
                                  "moe_layer); default all")
    a = p.parse_args(argv)
    t_start = time.perf_counter()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not a.cpu_smoke:
        print(json.dumps({"skipped": "gpu_bench: no CUDA device visible; this measures a GPU (docs/gpu.md). "
                                     "`--cpu-smoke` runs the same code at a tiny size on CPU."}))
        return 0
    mode = "gpu" if cuda and not a.cpu_smoke else "cpu-smoke"
    device = "cuda" if mode == "gpu" else "cpu"
    size = SIZES[mode]
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mode": mode,
                 "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "torch": torch.__version__, "model_shape": size["shape"],
                 "matmul_params": matmul_params(size["shape"]), "errors": {}, "skipped": []}
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from mrl.net import free_port

    os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what a bf16 run would use anyway for its fp32 parts
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    actor = None

    def section(name, fn, *args):
        if a.only and name != "model" and name not in a.only.split(","):
            return None
        if time.perf_counter() - t_start > a.budget_s:
            out["skipped"].append(f"{name}: time budget of {a.budget_s:.0f} s spent")
            return None
        t0 = time.perf_counter()
        print(f"gpu_bench: {name} ...", file=sys.stderr, flush=True)
        try:
            return fn(out, a, size, *args)
        except Exception as e:  # noqa: BLE001 -- one broken part must not hide the others
            out["errors"][name] = f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=4)
            return None
        finally:  # what is measured so far survives a host taken back mid-run
            print(f"gpu_bench: {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            if a.json:
                pathlib.Path(a.json).write_text(json.dumps(out, indent=1))

    model = section("model", lambda o, a_, s: write_model(s["shape"], s["dtype"], device, tmp / "model"))
    if model:
        actor = section("actor_fwd_bwd", bench_actor, model, device)
        section("engine_decode", bench_decode, model, device)
        if actor is not None:
            section("weight_sync", bench_sync, model, device, actor)
    section("moe_layer", bench_moe_layer, device)
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        pathlib.Path(a.json).write_text(text)
    return 0 if not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
