"""GPU evidence in one command (one GPU, <= 8 minutes, no network): a JSON of results and a readable table.

Device command (the lent H100/H200; wheels carried in .whl/, see docs/gpu.md 'Preparing the GPU host'):

    pip install -q --no-deps --target /tmp/site .whl/*.whl && \
      PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_bench.py --attention-backend all --out-dir $OUT

    python benchmarks/gpu_bench.py --cpu-smoke     # the same code at a tiny size on CPU (a test runs it)

stdout: the JSON object, then the summary table (the table last: a truncated log keeps it); --out-dir also gets
gpu_bench.json, rewritten after every section (a host taken back mid-run keeps what was measured).

What it measures, in one process (torch.distributed world size 1, Megatron TP = PP = 1; context_parallel launches
its own rank processes), at a Qwen2.5-1.5B shape
built from a config with random weights, bf16:

  actor_fwd_bwd   mrl's Megatron actor (``ActorWorker.forward_backward``: the update's forward and backward,
                  no optimizer step), 8 samples x 1024 tokens in micro-batches of 2, once per attention variant
                  (``--attention-backend``: ``local`` = Megatron's unfused DotProductAttention, ``sdpa`` = mrl's
                  SDPA core attention, ``te`` where Transformer Engine imports; ``all`` = each available one, and
                  with sdpa also ``sdpa+packed``: ``actor.use_remove_padding``, each micro-batch one row of whole
                  sequences through varlen_attn): seconds per mini-batch, model TFLOP/s and MFU = achieved / the
                  GPU's dense bf16 peak. FLOPs = 6·N·T + 12·L·h·s·T (N = matmul weights incl. the LM head,
                  T tokens, L layers, h hidden, s tokens per sequence: Megatron's count, attention not halved for
                  causality, recomputation not counted)
  weight_sync     the actor's HF-named export copied into the embedded engine (``InProcessEngine.load_weights``,
                  what transport=inprocess does), GB/s, and its ratio to a plain device-to-device copy of
                  the same number of bytes (torch ``copy_`` of one flat buffer)
  long_context    (a) the same step and variants at 8 x 4096 tokens, micro-batch 1 (every forward one whole
                  4096-token sequence; all sequences full length, so packing removes no padding here: sdpa+packed
                  vs sdpa is the packed path's own cost); (b) the longest single sequence that trains (forward +
                  backward + optimizer step, sdpa, padded rows), doubling from 4096 to 131072 tokens until CUDA
                  runs out of memory, with full activation recompute (first) and without (Megatron
                  recompute_granularity=full, recompute_method=uniform, recompute_num_layers=1, put into the
                  actor's TransformerConfig through build_model_chunks' config_overrides): per length one step's
                  seconds, torch.cuda.max_memory_allocated, TFLOP/s; the last length that fit. Goals printed next
                  to the figures: MFU >= 40 %, >= 32768 tokens per sequence with recompute
  engine_decode   the embedded engine (mrl/rollout/engine, over its HTTP API as the trainer uses it) vs
                  ``transformers.generate`` (sampling, same model, same dtype): generated tokens/s at
                  batch 64 and 256, fixed prompt and output lengths (ignore_eos / min_new_tokens)
  moe_layer       one Mixture-of-Experts decoder layer (Megatron's MoE layer as mrl builds it: SequentialMLP
                  experts on the local spec, all-to-all dispatcher, EP = 1) at a Qwen3-30B-A3B layer shape
                  (hidden 2048, 128 experts of width 768, top-8) in bf16: forward+backward tokens/s and
                  TFLOP/s of the active weights (6·N_active·T, attention's s-term left out)
  context_parallel (benchmarks/gpu_bench_cp.py) one 32768-token sequence's update (sdpa, packed, full recompute)
                  at CP=1 on one GPU against CP=2, 4, 8 over as many GPUs as are visible (rank processes, NCCL):
                  seconds, tokens/s, per-GPU peak memory and their ratios to CP=1. With one GPU visible: not
                  measured, and said so
  qwen35_hybrid   (benchmarks/gpu_bench_hybrid.py) a Qwen3.5-4B-shaped hybrid (Gated DeltaNet : gated full
                  attention 3 : 1, partial RoPE 0.25, zero-centred norms; text-only Qwen3_5ForCausalLM, random
                  weights): the actor's update step (8 x 1024 tokens, micro-batch 2, sdpa, packed rows) with MFU by
                  the hybrid's FLOP count (6·N·T + 12·L_full·n_h·d_h·s·T + the chunked delta rule's term: no s² in
                  the linear layers), and the longest single sequence that trains with full recompute (the search
                  above, packed rows); which gated-delta-rule kernel ran (fla or mrl's torch path).
                  Own budget: --hybrid-budget-s

``levers`` (in the JSON and the table), each one's gain where it is a switch in mrl: attention sdpa vs local,
packed rows vs padded rows, full recompute (longest sequence without -> with, and its step-time cost).
``torch.compile`` of the layer's elementwise parts is not a switch in mrl, so it is listed as not measured.

Each section (and each variant inside one) catches its own failure (``errors`` in the JSON) so one broken part
does not hide the others; a section is skipped once the time budget (``--budget-s``) is spent, and the long-context
search stops before a length whose estimated step would overrun ``--long-budget-s``. Without a CUDA device it
prints {"skipped": ...} and exits 0 unless ``--cpu-smoke`` is given (then the long-context search runs at
16..128 tokens and an out-of-memory error is simulated above 64 tokens, to exercise the OOM path; nothing there
is a measurement).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
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
            "decode": ((64, 256), 32, 128), "iters": 3, "moe": (QWEN3_MOE_LAYER, 4, 2048),
            # long_context: (samples, tokens per sample, micro-batch) of the MFU step, its timed iterations, the
            # search's first and last length (doubling)
            "long": {"mfu": (8, 4096, 1), "iters": 2, "search": (4096, 131072), "simulated_oom_above": None}},
    "cpu-smoke": {"shape": TINY, "dtype": "float32", "update": (4, 6, 6), "micro": 2, "decode": ((4, 8), 4, 4),
                  "iters": 1, "moe": (TINY_MOE, 2, 16),
                  "long": {"mfu": (4, 32, 1), "iters": 1, "search": (16, 128), "simulated_oom_above": 64}},
}
GOALS = {"mfu": 0.40, "recompute_tokens": 32768}
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
LONG_MAX_POSITIONS = 131072  # the long-context model's max_position_embeddings (no length check stops the search)


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def matmul_params(c: dict) -> int:
    """Weights that enter a matmul per token: attention, MLP, and the LM head (tied or not)."""
    h, i, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = h // c["num_attention_heads"]
    qkv = h * (h + 2 * c["num_key_value_heads"] * hd)
    return L * (qkv + h * h + 3 * h * i) + c["vocab_size"] * h


def model_flops(c: dict, tokens: int, seq: int) -> int:
    """Model FLOPs of one forward+backward over ``tokens`` tokens in sequences of ``seq`` (the docstring's count;
    a hybrid Qwen3.5 shape: gpu_bench_hybrid's count, whose linear-attention layers have no s² term)."""
    import gpu_bench_hybrid

    if gpu_bench_hybrid.is_hybrid(c):
        return gpu_bench_hybrid.hybrid_flops(c, tokens, seq)
    return 6 * matmul_params(c) * tokens + 12 * c["num_hidden_layers"] * c["hidden_size"] * seq * tokens


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """Drop what the last actor left (collect its cycles, return the allocator's cache)."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    """torch.cuda.max_memory_allocated since the last reset_peak, GiB (None on CPU)."""
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


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


def long_model(model: str, path: pathlib.Path) -> str:
    """The same checkpoint (files linked, not copied) with max_position_embeddings = LONG_MAX_POSITIONS."""
    src = pathlib.Path(model)
    path.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings", 0)), LONG_MAX_POSITIONS)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
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


# ---- attention variants --------------------------------------------------------------------------------
def backends_for(choice: str) -> list[str]:
    """The attention backends ``--attention-backend`` asks for that this host can build (te: TE importable on
    CUDA, :func:`mrl.megatron.provider.te_usable`)."""
    from mrl.megatron.provider import te_usable

    te = te_usable()
    if choice == "all":
        return ["local", "sdpa"] + (["te"] if te else [])
    if choice == "te" and not te:
        raise ValueError("--attention-backend te: Transformer Engine is not importable on CUDA in this process; "
                         "use local, sdpa or all (all adds te only where it imports)")
    return [choice]


def variants_for(backends: list[str]) -> list[tuple[str, str, bool]]:
    """(label, attention backend, packed rows) of each measured configuration: every backend on padded rows,
    and with sdpa also packed rows (``actor.use_remove_padding``: packed rows need the sdpa backend)."""
    out = [(b, b, False) for b in backends]
    if "sdpa" in backends:
        out.append(("sdpa+packed", "sdpa", True))
    return out


@contextlib.contextmanager
def config_overrides(extra: dict | None):
    """Megatron TransformerConfig fields added to every ``build_model_chunks`` call inside the block (through its
    ``config_overrides``): how the long-context search switches full activation recompute on in mrl's actor."""
    if not extra:
        yield
        return
    from mrl.megatron import provider

    orig = provider.build_model_chunks

    def build(*args, config_overrides=None, **kw):
        return orig(*args, config_overrides={**(config_overrides or {}), **extra}, **kw)

    provider.build_model_chunks = build
    try:
        yield
    finally:
        provider.build_model_chunks = orig


def build_actor(model: str, device: str, size: dict, *, samples: int, micro: int, backend: str, packed: bool,
                overrides: dict | None = None):
    import torch

    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker

    with config_overrides(overrides):
        return ActorWorker(ActorConfig(ppo_micro_batch_size_per_gpu=micro), model_path=model, device=device,
                           mini_batch_size_samples=samples, seed=0, dtype=getattr(torch, size["dtype"]),
                           attention_backend=backend, remove_padding=packed)


def simulate_oom_above(actor, cap: int) -> None:
    """cpu-smoke only: the decoder raises torch.cuda.OutOfMemoryError on rows longer than ``cap`` tokens, so the
    search's out-of-memory path (catch, free, report the last length that fit) runs on CPU too."""
    import torch

    from mrl.megatron.unwrap import unwrap

    def hook(_mod, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        if hs is not None and hs.shape[0] > cap:
            raise torch.cuda.OutOfMemoryError(f"cpu-smoke: simulated out of memory above {cap} tokens")

    for c in actor.model.chunks:
        unwrap(c).decoder.register_forward_pre_hook(hook, with_kwargs=True)


def built(actor) -> dict:
    """What the built actor runs (not what was asked for): its attention backend, core-attention class, packed
    rows, activation recompute."""
    m = actor.model
    core = sorted({type(x).__name__ for n, x in m.chunks[0].named_modules() if n.endswith("core_attention")})
    return {"attention_backend": m.attention_backend, "core_attention": core, "remove_padding": m.remove_padding,
            "recompute_granularity": m.config.recompute_granularity}


def time_update(actor, batch, iters: int, device: str) -> tuple[float, float]:
    """(seconds per forward_backward after one warm-up, pad fraction of the timed calls)."""
    actor.forward_backward(batch)  # warm-up (allocator, kernels)
    sync(device)
    actor.model.pad_fraction()  # reset the counter: the timed calls only
    t0 = time.perf_counter()
    for _ in range(iters):
        actor.forward_backward(batch)
    sync(device)
    return (time.perf_counter() - t0) / iters, actor.model.pad_fraction()


def measure_variants(out: dict, a, size: dict, model: str, device: str, variants, *, key: str, batch_shape,
                     micro: int, iters: int, deadline: float | None = None, keep_last: bool = False):
    """Each variant's forward+backward of one mini-batch (update_batch(*batch_shape)) in micro-batches of
    ``micro``; a variant that fails or runs out of memory is recorded and the next one runs. Returns the last
    actor built when ``keep_last`` (else frees each)."""
    import torch

    B, P, R = batch_shape
    c = size["shape"]
    T, seq = B * (P + R), P + R
    flops = model_flops(c, T, seq)
    peak = peak_tflops(out["device"]) if device == "cuda" else None
    res: dict = {}
    actor = None
    batch = update_batch(B, P, R, c["vocab_size"])
    for label, backend, packed in variants:
        actor = None
        release(device)
        row = res[label] = {"attention_backend": backend, "packed_rows": packed}
        if deadline is not None and time.perf_counter() > deadline:
            row["skipped"] = "time budget spent"
            continue
        try:
            reset_peak(device)
            t0 = time.perf_counter()
            actor = build_actor(model, device, size, samples=B, micro=micro, backend=backend, packed=packed)
            row["build_s"] = round(time.perf_counter() - t0, 2)
            row["built"] = built(actor)
            s, pad = time_update(actor, batch, iters, device)
            row.update({"seconds_per_minibatch": round(s, 4), "tflops": round(flops / s / 1e12, 6),
                        "mfu": round(flops / s / 1e12 / peak, 4) if peak else None, "pad_fraction": round(pad, 4),
                        "peak_gib": peak_gib(device)})
            if a.profile:
                out.setdefault(key.replace("fwd_bwd", "profile"), {})[label] = profiled(
                    device, lambda act=actor: act.forward_backward(batch))
        except torch.cuda.OutOfMemoryError as e:
            row.update({"oom": True, "peak_gib": peak_gib(device), "error": str(e).splitlines()[0][:200]})
        except Exception as e:  # noqa: BLE001 -- one broken variant must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out["errors"][f"{key}:{label}"] = f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=6)
        finally:
            if not keep_last:
                actor = None
    base = res.get("local", {}).get("seconds_per_minibatch")
    for row in res.values():
        if base and row.get("seconds_per_minibatch"):
            row["speedup_vs_local"] = round(base / row["seconds_per_minibatch"], 3)
    summary = {"samples": B, "tokens": T, "seq_len": seq, "micro_batch": micro, "dtype": size["dtype"],
               "flops_per_minibatch": flops, "peak_tflops": peak, "goal_mfu": GOALS["mfu"], "by_variant": res}
    return summary, actor


def bench_actor(out: dict, a, size: dict, model: str, device: str, variants):
    B, P, R = size["update"]
    out["actor_fwd_bwd"], actor = measure_variants(
        out, a, size, model, device, variants, key="actor_fwd_bwd", batch_shape=(B, P, R), micro=size["micro"],
        iters=size["iters"], keep_last=True)
    return actor


def search_longest(out: dict, size: dict, model: str, device: str, backend: str, recompute: bool,
                   deadline: float, *, packed: bool = False, key: str = "long_context") -> dict:
    """The longest single sequence one training step (forward + backward + optimizer step) fits, doubling
    from the first length until CUDA runs out of memory (or the time budget would be overrun); padded rows, or
    with ``packed`` one packed row per step (errors recorded under ``key``)."""
    import torch

    L, c = size["long"], size["shape"]
    first, last = L["search"]
    lengths = []
    n = first
    while n <= last:
        lengths.append(n)
        n *= 2
    peak = peak_tflops(out["device"]) if device == "cuda" else None
    res: dict = {"recompute": recompute, "attention_backend": backend,
                 "rows": f"{'packed' if packed else 'padded'}, one sequence per step",
                 "by_length": {}, "longest": None}
    actor = None
    if time.perf_counter() > deadline:
        res["skipped"] = "long-context time budget spent"
        return res
    try:
        actor = build_actor(model, device, size, samples=1, micro=1, backend=backend, packed=packed,
                            overrides=RECOMPUTE if recompute else None)
        res["built"] = built(actor)
        res["config"] = {k: getattr(actor.model.config, k) for k in RECOMPUTE}  # what the built model runs
        if L["simulated_oom_above"]:
            simulate_oom_above(actor, L["simulated_oom_above"])
            res["simulated_oom_above"] = L["simulated_oom_above"]

        def step(n: int) -> None:
            batch = update_batch(1, n // 4, n - n // 4, c["vocab_size"])
            actor.optimizer_step(actor.forward_backward(batch), {})
            sync(device)

        prev = None
        for i, n in enumerate(lengths):
            if prev is not None and time.perf_counter() + 4.5 * prev > deadline:  # ~4x per doubling (attention)
                res["by_length"][str(n)] = {"fits": None, "not_tried": "its estimated step would overrun the "
                                                                       "long-context time budget"}
                break
            reset_peak(device)
            try:
                if i == 0:
                    step(n)  # warm-up (kernels, allocator), not timed
                t0 = time.perf_counter()
                step(n)
            except torch.cuda.OutOfMemoryError as e:
                res["by_length"][str(n)] = {"fits": False, "oom": True, "peak_gib": peak_gib(device),
                                            "error": str(e).splitlines()[0][:200]}
                break
            s = time.perf_counter() - t0
            f = model_flops(c, n, n)
            res["by_length"][str(n)] = {"fits": True, "seconds": round(s, 3), "peak_gib": peak_gib(device),
                                        "tflops": round(f / s / 1e12, 6),
                                        "mfu": round(f / s / 1e12 / peak, 4) if peak else None}
            res["longest"] = n
            prev = s
    except Exception as e:  # noqa: BLE001 -- not an OOM: recorded, the other search still runs
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["errors"][f"{key}:{'with' if recompute else 'no'}_recompute"] = (
            f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=6))
    finally:
        actor = None
        release(device)
    return res


def bench_long_context(out: dict, a, size: dict, model: str, device: str, variants):
    t0 = time.perf_counter()
    deadline = t0 + a.long_budget_s
    L = size["long"]
    B, S, micro = L["mfu"]
    res: dict = {"budget_s": a.long_budget_s}
    out["long_context"] = res
    res["mfu"], _ = measure_variants(out, a, size, model, device, variants, key="long_context", micro=micro,
                                     batch_shape=(B, S // 4, S - S // 4), iters=L["iters"], deadline=deadline)
    backend = "sdpa" if any(v[1] == "sdpa" for v in variants) else variants[0][1]
    vocab_padded = -(-size["shape"]["vocab_size"] // 128) * 128
    res["longest"] = {"first": L["search"][0], "last": L["search"][1], "goal_with_recompute": GOALS["recompute_tokens"],
                      # what bounds it at the top: the LM head's logits, [n, padded vocab] in fp32 (computed, not measured)
                      "logits_fp32_gib_per_1024_tokens": round(1024 * vocab_padded * 4 / 2**30, 3)}
    for recompute in (True, False):  # the goal's figure first; a sixth of the budget (45 s of 270) left to the other
        k = "with_recompute" if recompute else "no_recompute"
        until = deadline - a.long_budget_s / 6 if recompute else deadline
        res["longest"][k] = search_longest(out, size, model, device, backend, recompute, until)
    res["seconds"] = round(time.perf_counter() - t0, 1)


# ---- levers and the table ----------------------------------------------------------------------------
def levers(out: dict) -> list[dict]:
    """Each lever of the step (sdpa vs local first, torch.compile last, as issue 43 lists them), with its gain where this run measured both sides."""
    def speed(section: dict | None, a_: str, b: str):
        rows = (section or {}).get("by_variant", {})
        sa, sb = rows.get(a_, {}).get("seconds_per_minibatch"), rows.get(b, {}).get("seconds_per_minibatch")
        return round(sb / sa, 3) if sa and sb else None

    act, lc = out.get("actor_fwd_bwd"), (out.get("long_context") or {}).get("mfu")
    rows = [{"lever": "attention: sdpa instead of local (megatron.attention_backend)", "unit": "speed-up",
             "actor_fwd_bwd": speed(act, "sdpa", "local"), "long_context": speed(lc, "sdpa", "local")},
            {"lever": "packed rows instead of padded (actor.use_remove_padding, sdpa; equal lengths: no padding "
                      "to remove, so this is the packed path's own cost)", "unit": "speed-up",
             "actor_fwd_bwd": speed(act, "sdpa+packed", "sdpa"), "long_context": speed(lc, "sdpa+packed", "sdpa")}]
    if any(v.get("attention_backend") == "te" for v in ((act or {}).get("by_variant") or {}).values()):
        rows.insert(1, {"lever": "attention: te instead of sdpa", "unit": "speed-up",
                        "actor_fwd_bwd": speed(act, "te", "sdpa"), "long_context": speed(lc, "te", "sdpa")})
    lo = ((out.get("long_context") or {}).get("longest") or {})
    no, yes = lo.get("no_recompute") or {}, lo.get("with_recompute") or {}
    both = [n for n, r in (no.get("by_length") or {}).items()
            if r.get("fits") and (yes.get("by_length") or {}).get(n, {}).get("fits")]
    cost = None
    if both:
        n = max(both, key=int)
        cost = {"tokens": int(n), "step_time_ratio": round(yes["by_length"][n]["seconds"] / no["by_length"][n]["seconds"], 3)}
    rows.append({"lever": "full activation recompute (recompute_granularity=full, uniform, 1 layer)",
                 "unit": "longest sequence", "without": no.get("longest"), "with": yes.get("longest"),
                 "cost_at_longest_common": cost})
    rows.append({"lever": "torch.compile of the layer's elementwise parts", "unit": None,
                 "not_measured": "not a switch in mrl (nothing to turn on); listed so the table is complete"})
    return rows


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _num(x, fmt: str = ".3g") -> str:
    return "-" if x is None else format(x, fmt)


def table(out: dict) -> str:
    """The summary: every measured figure with its goal where the issue sets one."""
    lines = [(f"gpu_bench summary: {out.get('device')} ({out.get('mode')}), torch {out.get('torch')}, "
              f"goals: MFU >= {GOALS['mfu']:.0%}, >= {GOALS['recompute_tokens']} tokens per sequence with recompute")]

    def variants_block(title: str, sec: dict | None) -> None:
        if not sec:
            return
        lines.append(f"\n{title}: {sec['samples']} x {sec['seq_len']} tokens, micro-batch {sec['micro_batch']}, "
                     f"{sec['dtype']}, forward+backward (no optimizer step)")
        lines.append(f"  {'variant':<13} {'s/mini-batch':>12} {'TFLOP/s':>9} {'MFU':>8} {'goal':>6} {'vs local':>9} "
                     f"{'peak GiB':>9} {'pad':>6}")
        for label, r in sec["by_variant"].items():
            if "seconds_per_minibatch" not in r:
                why = r.get("skipped") or ("out of memory" if r.get("oom") else r.get("error", "?"))
                lines.append(f"  {label:<13} {why[:90]}" + (f" (peak {r['peak_gib']} GiB)" if r.get("peak_gib") else ""))
                continue
            lines.append(f"  {label:<13} {r['seconds_per_minibatch']:>12.4f} {_num(r['tflops'], '.4g'):>9} "
                         f"{_pct(r['mfu']):>8} {GOALS['mfu']:>6.0%} {_num(r.get('speedup_vs_local'), '.2f'):>9} "
                         f"{_num(r['peak_gib'], '.1f'):>9} {r['pad_fraction']:>6.3f}")

    variants_block("actor_fwd_bwd", out.get("actor_fwd_bwd"))
    lc = out.get("long_context") or {}
    variants_block("long_context", lc.get("mfu"))
    lo = lc.get("longest")
    if lo:
        no, yes = lo.get("no_recompute") or {}, lo.get("with_recompute") or {}
        lines.append(f"\nlongest single sequence that trains (forward + backward + optimizer step), "
                     f"{yes.get('attention_backend') or no.get('attention_backend')}, padded rows, doubling "
                     f"{lo['first']} -> {lo['last']}; logits alone: {lo['logits_fp32_gib_per_1024_tokens']} GiB fp32 "
                     "per 1024 tokens (computed)")
        lines.append(f"  {'tokens':>8}   {'no recompute':<40} {'full recompute':<40}")

        def cell(r: dict | None) -> str:
            if not r:
                return "-"
            if r.get("fits"):
                return f"fits {r['seconds']:.2f} s, peak {_num(r['peak_gib'], '.1f')} GiB, {_pct(r['mfu'])}"
            if r.get("oom"):
                return f"OOM (peak {_num(r.get('peak_gib'), '.1f')} GiB)"
            return "not tried (time budget)"

        keys = sorted({*no.get("by_length", {}), *yes.get("by_length", {})}, key=int)
        for n in keys:
            lines.append(f"  {n:>8}   {cell(no.get('by_length', {}).get(n)):<40} {cell(yes.get('by_length', {}).get(n)):<40}")
        goal = GOALS["recompute_tokens"]
        met = yes.get("longest") is not None and yes["longest"] >= goal
        with_r = f"{yes.get('longest')} (goal >= {goal}: {'met' if met else 'not met'})"
        lines.append(f"  {'longest':>8}   {no.get('longest')!s:<40} {with_r:<40}")
        for k, r in (("no recompute", no), ("full recompute", yes)):
            if r.get("error") or r.get("skipped"):
                lines.append(f"  {k}: {r.get('error') or r.get('skipped')}")
        if no.get("simulated_oom_above") or yes.get("simulated_oom_above"):
            lines.append("  (cpu-smoke: out of memory simulated above "
                         f"{yes.get('simulated_oom_above') or no.get('simulated_oom_above')} tokens)")
    lev = out.get("levers")
    if lev:
        lines.append("\nlevers (issue 43: sdpa vs local first, torch.compile last; gain where this run measured both sides)")
        for i, r in enumerate(lev, 1):
            if r.get("not_measured"):
                lines.append(f"  {i}. {r['lever']}: not measured ({r['not_measured']})")
            elif r["unit"] == "speed-up":
                lines.append(f"  {i}. {r['lever']}: x{_num(r['actor_fwd_bwd'], '.2f')} at actor_fwd_bwd's shape, "
                             f"x{_num(r['long_context'], '.2f')} at long_context's")
            else:
                c = r.get("cost_at_longest_common")
                lines.append(f"  {i}. {r['lever']}: longest {r['without']} -> {r['with']} tokens"
                             + (f"; step time x{c['step_time_ratio']:.2f} at {c['tokens']} tokens" if c else ""))
    dec, ws, moe = out.get("engine_decode"), out.get("weight_sync"), out.get("moe_layer")
    if dec or ws or moe:
        lines.append("")
    if dec:
        for b, r in dec["by_batch"].items():
            lines.append(f"engine_decode batch {b}: mrl {r['mrl_tok_s']} vs transformers {r.get('hf_tok_s')} tok/s "
                         f"(x{_num(r.get('ratio'), '.2f')})")
    if ws:
        lines.append(f"weight_sync: {ws['bytes'] / 1e9:.2f} GB in {ws['seconds']} s, {ws['gb_s']} GB/s "
                     f"(ratio to a device copy {ws['ratio_to_d2d']})")
    if moe:
        lines.append(f"moe_layer: {moe['tokens']} tokens, {moe['seconds_per_fwd_bwd']} s fwd+bwd, "
                     f"{moe['tokens_per_s']} tokens/s, {moe['tflops_active']} TFLOP/s active")
    hy = out.get("qwen35_hybrid")
    if hy:
        u = ((hy.get("update") or {}).get("by_variant") or {}).get("sdpa+packed") or {}
        lo = hy.get("longest") or {}
        lines.append(f"qwen35_hybrid ({hy['layer_types'].count('full_attention')} of {len(hy['layer_types'])} layers "
                     f"full attention, delta rule: {hy['delta_rule_kernel']}): update "
                     f"{_num(u.get('seconds_per_minibatch'), '.4f')} s, {_num(u.get('tflops'), '.4g')} TFLOP/s, MFU "
                     f"{_pct(u.get('mfu'))}; longest sequence with recompute {lo.get('longest')} tokens")
    import gpu_bench_cp

    cp = gpu_bench_cp.summary(out.get("context_parallel"))
    if cp:
        lines += ["", *cp]
    if out.get("errors"):
        lines.append("\nerrors: " + "; ".join(f"{k}: {v.splitlines()[0][:160]}" for k, v in out["errors"].items()))
    if out.get("skipped"):
        lines.append("skipped: " + "; ".join(out["skipped"]))
    return "\n".join(lines)


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
    p.add_argument("--attention-backend", choices=["local", "sdpa", "te", "all"], default="all",
                   help="attention of the actor sections: one backend, or all available ones in this run (te only "
                        "where Transformer Engine imports; with sdpa also sdpa+packed)")
    p.add_argument("--budget-s", type=float, default=420, help="skip the sections not started after this many seconds")
    p.add_argument("--long-budget-s", type=float, default=270,
                   help="long_context's own budget: no variant or search step starts that would overrun it")
    p.add_argument("--hybrid-budget-s", type=float, default=200,
                   help="qwen35_hybrid's own budget (checkpoint, update step, longest-sequence search)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or None,
                   help="write gpu_bench.json here (default: $OUT when set)")
    p.add_argument("--json", help="also write the JSON to this file")
    p.add_argument("--profile", action="store_true", help="also profile one actor step and one decode request")
    p.add_argument("--only", help="comma-separated sections to run (actor_fwd_bwd, weight_sync, long_context, "
                                  "engine_decode, context_parallel, moe_layer, qwen35_hybrid); default all")
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
                 "matmul_params": matmul_params(size["shape"]), "goals": GOALS, "errors": {}, "skipped": []}
    paths = [pathlib.Path(x) for x in (a.json, a.out_dir and os.path.join(a.out_dir, "gpu_bench.json")) if x]
    for x in paths:
        x.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # what is measured so far survives a host taken back mid-run
        for x in paths:
            x.write_text(json.dumps(out, indent=1))

    try:
        backends = backends_for(a.attention_backend)
    except ValueError as e:
        out["errors"]["attention_backend"] = str(e)
        save()
        print(json.dumps(out, indent=1))
        return 2
    variants = variants_for(backends)
    out["attention_backends"] = backends
    out["variants"] = [v[0] for v in variants]
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from mrl.net import free_port

    os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what a bf16 run would use anyway for its fp32 parts
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gpu_bench_"))

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
        finally:
            print(f"gpu_bench: {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            save()

    dense = ("actor_fwd_bwd", "weight_sync", "long_context", "engine_decode", "context_parallel")
    model = None
    if not a.only or set(dense) & set(a.only.split(",")):  # the Qwen2.5 checkpoint only for the sections using it
        model = section("model", lambda o, a_, s: write_model(s["shape"], s["dtype"], device, tmp / "model"))
    if model:
        actor = section("actor_fwd_bwd", bench_actor, model, device, variants)
        if actor is not None:
            section("weight_sync", bench_sync, model, device, actor)
        actor = None
        release(device)  # the long-context steps get the whole device
        long = long_model(model, tmp / "model_long")
        section("long_context", bench_long_context, long, device, variants)
        section("engine_decode", bench_decode, model, device)
        release(device)  # the CP ranks are other processes: this one keeps as little as it can on device 0
        import gpu_bench_cp

        section("context_parallel", gpu_bench_cp.run, device, long)
    section("moe_layer", bench_moe_layer, device)
    import gpu_bench_hybrid

    section("qwen35_hybrid", gpu_bench_hybrid.run, device, sys.modules[__name__], tmp)
    out["levers"] = levers(out)
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    print(json.dumps(out, indent=1))
    print("\n" + table(out), flush=True)
    return 0 if not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
