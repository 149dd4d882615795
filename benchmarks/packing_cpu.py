"""The actor update on CPU: padded rows vs packed rows (``actor.use_remove_padding``), and sdpa vs local attention.

Workload: one gloo rank, a tiny Qwen2-style model (``--hidden``, ``--layers``), one GRPO-shaped batch of
``--samples`` samples with a 64-token prompt and ragged responses (log-normal around ``--mean-response``
tokens, 10 % at the ``--max-response`` budget: an RL rollout's shape), micro-batches by token budget
(``use_dynamic_bsz``, ``--max-tokens`` per micro-batch), fp32. Each variant builds the same actor and runs
``--repeats`` updates (forward + backward + Adam) after one warm-up; the time is the process CPU time of the
updates (one torch thread: CPU time is the work done, robust when other jobs share the host) and the wall time.

    .venv/bin/python benchmarks/packing_cpu.py [--samples 64 --max-response 512]

Prints one line per variant: seconds per update, positions computed, ``perf/pad_fraction``, and the ratio to
the padded sdpa rows (what mrl ran before packing).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = [("local", False), ("sdpa", False), ("sdpa", True)]


def _batch(samples: int, prompt: int, max_response: int, mean_response: int, seed: int):
    from mrl.workers.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(samples, generator=g) * 0.6 + math.log(mean_response)).long().clamp(1, max_response)
    lengths[torch.rand(samples, generator=g) < 0.1] = max_response
    R = int(lengths.max())
    ids = torch.randint(3, 250, (samples, prompt + R), generator=g)
    am = torch.cat([torch.ones(samples, prompt, dtype=torch.long),
                    (torch.arange(R)[None, :] < lengths[:, None]).long()], 1)
    ids = ids * am
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    resp_mask = am[:, prompt:].clone()
    return TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, prompt:].clone(),
                      response_mask=resp_mask, old_log_probs=-torch.rand(samples, R, generator=g) * resp_mask,
                      advantages=torch.randn(samples, R, generator=g) * resp_mask, uid=torch.arange(samples) // 8)


def _rank(rank, world, path, args):
    import resource  # noqa: F401  (CPU time below)

    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker

    torch.set_num_threads(1)
    batch = _batch(args["samples"], 64, args["max_response"], args["mean_response"], 0)
    out = []
    for backend, packed in VARIANTS:
        cfg = ActorConfig(megatron={"attention_backend": backend}, use_dynamic_bsz=True,
                          ppo_max_token_len_per_gpu=args["max_tokens"], use_distributed_optimizer=False,
                          ppo_mini_batch_size=args["samples"])
        actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=args["samples"], seed=1,
                            remove_padding=packed)
        actor.update_policy(batch)  # warm-up
        cpu0, wall0 = time.process_time(), time.perf_counter()
        pads = []
        for _ in range(args["repeats"]):
            pads.append(actor.update_policy(batch)["perf/pad_fraction"])
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        out.append({"backend": backend, "packed": packed, "cpu_s": cpu / args["repeats"],
                    "wall_s": wall / args["repeats"], "pad_fraction": pads[-1]})
        del actor
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--mean-response", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=str, default=None, help="also write the results here")
    a = p.parse_args()
    from tests.helpers.dist import run_ranks
    from tests.helpers.tiny_models import make_tiny_hf

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_hf(Path(tmp) / "m", "qwen2", hidden_size=a.hidden, num_hidden_layers=a.layers,
                            max_position_embeddings=4096)
        res = run_ranks(_rank, 1, args=(str(path), vars(a) | {"max_response": a.max_response}), timeout_s=1800)[0]
    base = next(r for r in res if r["backend"] == "sdpa" and not r["packed"])
    for r in res:
        r["cpu_ratio_vs_padded_sdpa"] = r["cpu_s"] / base["cpu_s"]
        print(f"{r['backend']:5s} {'packed' if r['packed'] else 'padded':6s}  {r['cpu_s']:.2f} CPU-s/update  "
              f"{r['wall_s']:.2f} s wall  pad_fraction {r['pad_fraction']:.3f}  "
              f"x{r['cpu_ratio_vs_padded_sdpa']:.2f} of padded sdpa")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": res}, indent=1))


if __name__ == "__main__":
    main()
