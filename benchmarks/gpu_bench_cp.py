"""gpu_bench's ``context_parallel`` section: one long sequence's update at CP=1 on one device against CP=N over N
devices (context parallelism on the sdpa backend, mrl/megatron/context_parallel.py; docs/long_context.md).

Each CP size is its own launch of N rank processes (``mrl.local_ranks``: NCCL on CUDA, one device per rank; gloo on
CPU). Every rank builds the actor on gpu_bench's long-context checkpoint (Qwen2.5-1.5B's shape, random weights,
max_position_embeddings raised), runs one warm-up ``forward_backward`` (no optimizer step) of one packed row holding
one sequence of ``tokens`` tokens, then the timed ones. Reported per CP size: seconds per update, tokens/s, each
device's peak memory (``torch.cuda.max_memory_allocated`` after a reset, the parameters and gradient buffers
included), the loss (the same update at every CP size: equal up to bf16 summation order); and against CP=1 the
speed-up and the peak-memory ratio (ideal 1/N for activations; the weights, gradients and the gathered K/V of
every layer are not split).

With one GPU visible nothing is measured and the section says so: CP's speed and memory over several GPUs are not
estimated from one. ``--cpu-smoke``: the same code over gloo on CPU at a tiny size with 2 ranks (no memory figure:
``max_memory_allocated`` is CUDA's; nothing there is a measurement).
"""
from __future__ import annotations

import os
import time

# cpu-smoke: the ranks fork from a server that imported these once (mrl.local_ranks; none touches CUDA or starts a
# thread on import). On CUDA each rank is a fresh spawn, as Megatron-LM's launchers do.
PRELOAD = ("torch", "torch.distributed", "mrl.megatron", "megatron.core", "mrl.workers.actor", "gpu_bench")
SIZES = {  # tokens of the one sequence, full activation recompute, timed iterations, launch timeout (s)
    "gpu": {"tokens": 32768, "recompute": "full", "iters": 2, "timeout_s": 420},
    "cpu-smoke": {"tokens": 64, "recompute": None, "iters": 1, "timeout_s": 240},
}


def _rank(rank: int, model: str, device: str, dtype: str, tokens: int, recompute: str | None, iters: int) -> dict:
    import torch
    import torch.distributed as dist
    from gpu_bench import sync, update_batch

    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker

    world = int(os.environ["WORLD_SIZE"])
    cfg = ActorConfig(megatron={"attention_backend": "sdpa", "context_parallel_size": world},
                      use_remove_padding=True, ppo_micro_batch_size_per_gpu=1, use_distributed_optimizer=False,
                      recompute_granularity=recompute)
    actor = ActorWorker(cfg, model_path=model, device=device, mini_batch_size_samples=1, seed=0,
                        dtype=getattr(torch, dtype), attention_backend="sdpa", remove_padding=True)
    prompt = 16
    batch = update_batch(1, prompt, tokens - prompt, actor.vocab_size)
    actor.forward_backward(batch)  # warm-up: allocator, kernels, RoPE tables
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        m = actor.forward_backward(batch)
    sync(device)
    seconds = (time.perf_counter() - t0) / iters
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"seconds": seconds, "peak_gib": peak, "loss": float(m["loss"]), "cp": actor.model.cp_size}


def cp_sizes(devices: int) -> list[int]:
    """CP=1 and every power of two up to the devices visible (8 at most)."""
    return [1] + [c for c in (2, 4, 8) if c <= devices]


def run(out: dict, a, size: dict, device: str, model: str) -> dict:
    """The section (module docstring) on gpu_bench's long-context checkpoint ``model``."""
    import torch

    from mrl.local_ranks import run_local_ranks

    S = SIZES[out["mode"]]
    devices = torch.cuda.device_count() if device == "cuda" else 2
    res: dict = {"tokens": S["tokens"], "recompute": S["recompute"], "dtype": size["dtype"], "attention_backend": "sdpa",
                 "packed": True, "devices_visible": devices, "by_cp": {}}
    out["context_parallel"] = res
    if devices < 2:
        res["not_measured"] = ("one GPU visible: context parallelism splits a sequence over 2 or more devices; its "
                               "speed and memory are not measured here, nor estimated from one device")
        return res
    for cp in cp_sizes(devices):
        ranks = run_local_ranks(_rank, cp, (model, device, size["dtype"], S["tokens"], S["recompute"], S["iters"]),
                                timeout_s=S["timeout_s"], threads_per_rank=1 if device == "cpu" else None,
                                timeout_hint="gpu_bench context_parallel: a CP launch did not finish",
                                preload=PRELOAD if device == "cpu" else ())
        if any(r["cp"] != cp for r in ranks):
            raise RuntimeError(f"asked for CP={cp}, the actor ran CP={[r['cp'] for r in ranks]}")
        seconds = max(r["seconds"] for r in ranks)
        peaks = [r["peak_gib"] for r in ranks if r["peak_gib"] is not None]
        res["by_cp"][str(cp)] = {"seconds": round(seconds, 4), "tokens_per_s": round(S["tokens"] / seconds, 1),
                                 "peak_gib_per_device": round(max(peaks), 2) if peaks else None,
                                 "loss": ranks[0]["loss"]}
    one = res["by_cp"]["1"]
    for r in res["by_cp"].values():
        r["speedup_vs_cp1"] = round(one["seconds"] / r["seconds"], 3)
        r["peak_ratio_vs_cp1"] = (round(r["peak_gib_per_device"] / one["peak_gib_per_device"], 3)
                                  if one["peak_gib_per_device"] else None)
    return res


def summary(res: dict | None) -> list[str]:
    """gpu_bench's table lines of the section."""
    if not res:
        return []
    head = (f"context_parallel: one sequence of {res['tokens']} tokens, {res['dtype']}, sdpa, packed, recompute "
            f"{res['recompute']}, forward+backward")
    if res.get("not_measured"):
        return [f"{head}: not measured ({res['not_measured']})"]
    rows = [head, f"  {'CP':>3} {'s/update':>9} {'tokens/s':>10} {'peak GiB':>9} {'x CP1 speed':>12} {'x CP1 peak':>11}"]
    for cp, r in res["by_cp"].items():
        pk = "-" if r["peak_gib_per_device"] is None else f"{r['peak_gib_per_device']:.2f}"
        ratio = "-" if r["peak_ratio_vs_cp1"] is None else f"{r['peak_ratio_vs_cp1']:.3f}"
        rows.append(f"  {cp:>3} {r['seconds']:>9.4f} {r['tokens_per_s']:>10.1f} {pk:>9} {r['speedup_vs_cp1']:>12.3f} "
                    f"{ratio:>11}")
    return rows
