"""Tokens/s of the embedded engine vs batched ``transformers`` ``generate``, side by side.

Workload: 64 sequences, prompt 32 tokens each, response lengths ragged up to 128 (fixed seed),
same model and sampling (temperature 1.0, top_p 0.95, top_k 50) on both sides. Two request modes:

* burst (default, ``--requests 64``): exactly 64 requests at once; the engine's batch decays from
  64 to 1 as rows finish, ``generate`` runs one batch of 64 padded to its longest response.
* steady (``--requests N`` with N > 64, e.g. 256): N requests sent at once with at most 64 in
  flight, how RL uses the engine (the driver sends batch x n requests; ``--num-seqs`` is the
  engine's max running batch); the engine admits a waiting request as a row finishes, so its batch
  stays near 64 until the queue drains. ``generate`` takes the N requests in batches of 64, each
  padded to its own longest response — what a TRL-style loop over minibatches does.

Two length mixes:
``--lengths uniform`` (default; uniform in [8, 128], mean 75) and ``--lengths rl`` (the shape of
an RL rollout batch: 10 % truncated at the budget, the rest ending early, log-normal around 32
tokens; mean 38).
Useful tokens = sum of the response lengths on both sides: ``generate`` decodes each batch
until its longest response is done (rows past their length are waste), which is exactly what a
TRL user's rollout on CPU pays; the engine retires a row the step it finishes.

    .venv/bin/python benchmarks/engine_throughput.py [--hidden 256 --layers 4 --vocab 8192] [--requests 256]

Prints one line per side and the ratio engine/generate by process CPU time (robust when other
jobs share the host; with ``--threads 1`` CPU time is the work done) and by wall time.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model_dir(path: Path, hidden: int, layers: int, vocab: int) -> Path:
    import transformers as tf

    cfg = tf.Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32), num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--num-seqs", type=int, default=64,
                    help="concurrent sequences: the engine's max running batch and generate's batch size")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in all (default --num-seqs: one burst); more = steady load at --num-seqs in flight")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-response", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads; 1 makes process CPU time a clean measure of work")
    ap.add_argument("--engine-first", action="store_true", help="measure the engine before generate")
    ap.add_argument("--lengths", choices=["uniform", "rl"], default="uniform",
                    help="response-length mix (see the module docstring)")
    ap.add_argument("--equal-lengths", action="store_true",
                    help="every response max-response long: isolates per-step cost from ragged-length waste")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n_req = args.requests or args.num_seqs
    if n_req < args.num_seqs:
        raise SystemExit(f"--requests {n_req} < --num-seqs {args.num_seqs}: pass at least one full batch")

    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM

    from mrl.rollout.engine.server import Engine, build_app

    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(n_req)]
    if args.lengths == "uniform":
        lengths = [rng.randint(8, args.max_response) for _ in range(n_req)]
    else:
        lengths = [args.max_response if rng.random() < 0.1 else
                   max(8, min(args.max_response, int(math.exp(rng.gauss(math.log(32), 0.6)))))
                   for _ in range(n_req)]
    if args.equal_lengths:
        lengths = [args.max_response] * n_req
    useful = sum(lengths)
    # generate's batches: --num-seqs requests each, in order (the last one may be smaller)
    batches = [range(s, min(s + args.num_seqs, n_req)) for s in range(0, n_req, args.num_seqs)]
    hf_row_steps = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    sampling = {"temperature": 1.0, "top_p": 0.95, "top_k": 50}

    with tempfile.TemporaryDirectory() as tmp:
        d = build_model_dir(Path(tmp) / "m", args.hidden, args.layers, args.vocab)

        def run_generate() -> tuple[float, float]:
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            kw = dict(do_sample=True, pad_token_id=0, **sampling)
            # Full-size warm-up: the first large allocations of a process pay page faults (glibc
            # raises its mmap threshold only after frees), which would otherwise bias the first side.
            ids = torch.tensor([prompts[i] for i in batches[0]])
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, **kw)
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                for b in batches:
                    ids = torch.tensor([prompts[i] for i in b])
                    longest = max(lengths[i] for i in b)
                    # min_new_tokens: like ignore_eos on the engine side, every row runs to the longest
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=longest,
                                         min_new_tokens=longest, **kw)
                    assert out.shape[1] == args.prompt_len + longest
            return time.perf_counter() - t0, time.process_time() - c0

        def run_engine() -> tuple[float, float]:
            engine = Engine(str(d), max_running=args.num_seqs)
            with TestClient(build_app(engine)) as c:
                warm = prompts[: args.num_seqs]
                c.post("/generate", json={"input_ids": warm, "sampling_params": {"max_new_tokens": 8}})  # warm-up
                t0, c0 = time.perf_counter(), time.process_time()
                r = c.post("/generate", json={
                    "input_ids": prompts, "return_logprob": True,
                    "sampling_params": [{**sampling, "max_new_tokens": n, "ignore_eos": True} for n in lengths]})
                dt = (time.perf_counter() - t0, time.process_time() - c0)
                got = sum(len(o["output_ids"]) for o in r.json())
                assert got == useful, (got, useful)
                stats.update(engine.scheduler.stats)
            return dt

        stats: dict = {}
        if args.engine_first:
            t_eng = run_engine()
            t_hf = run_generate()
        else:
            t_hf = run_generate()
            t_eng = run_engine()

    (w_hf, c_hf), (w_eng, c_eng) = t_hf, t_eng
    mix = f"all {args.max_response}" if args.equal_lengths else f"{args.lengths} 8..{args.max_response}"
    mode = (f"burst: {n_req} requests at once" if n_req == args.num_seqs else
            f"steady: {n_req} requests, at most {args.num_seqs} in flight (generate: {len(batches)} batches)")
    print(f"model: qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}; mode {mode}; "
          f"prompt {args.prompt_len}, responses {mix} (sum {useful} useful tokens); torch threads {args.threads}")
    print(f"transformers generate: wall {w_hf:7.2f} s ({useful / w_hf:7.1f} tok/s)  cpu {c_hf:7.2f} s ({useful / c_hf:7.1f} tok/cpu-s)")
    print(f"mrl embedded engine:   wall {w_eng:7.2f} s ({useful / w_eng:7.1f} tok/s)  cpu {c_eng:7.2f} s "
          f"({useful / c_eng:7.1f} tok/cpu-s)  decode steps {stats.get('decode_steps')}, max batch {stats.get('max_batch')}")
    ratio = c_hf / c_eng
    print(f"ratio engine/generate: {ratio:.2f}x by CPU time, {w_hf / w_eng:.2f}x by wall time")
    # Where it comes from: generate runs every row of a batch until that batch's longest is done,
    # the engine only the useful row-steps; the rest is the cost of one row-step on each side.
    bound = hf_row_steps / useful
    print(f"  = {bound:.2f}x fewer row-steps (rows retired when done) x {ratio / bound:.2f}x cheaper row-step")
    return ratio


if __name__ == "__main__":
    main()
