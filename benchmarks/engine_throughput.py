"""Tokens/s of the embedded engine vs batched ``transformers`` ``generate``, side by side.

Workload: 64 sequences, prompt 32 tokens each, response lengths ragged up to 128 (fixed seed),
same model and sampling (temperature 1.0, top_p 0.95, top_k 50) on both sides. Two length mixes:
``--lengths uniform`` (default; uniform in [8, 128], mean 75) and ``--lengths rl`` (the shape of
an RL rollout batch: 10 % truncated at the budget, the rest ending early, log-normal around 32
tokens; mean 38).
Useful tokens = sum of the 64 response lengths on both sides: ``generate`` decodes the whole
batch until the longest response is done (rows past their length are waste), which is exactly
what a TRL user's rollout on CPU pays; the engine retires a row the step it finishes.

    .venv/bin/python benchmarks/engine_throughput.py [--hidden 256 --layers 4 --vocab 8192]

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
    ap.add_argument("--num-seqs", type=int, default=64)
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

    from fastapi.testclient import TestClient
    from transformers import AutoModelForCausalLM

    from mrl.rollout.server import Engine, build_app

    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    if args.lengths == "uniform":
        lengths = [rng.randint(8, args.max_response) for _ in range(args.num_seqs)]
    else:
        lengths = [args.max_response if rng.random() < 0.1 else
                   max(8, min(args.max_response, int(math.exp(rng.gauss(math.log(32), 0.6)))))
                   for _ in range(args.num_seqs)]
    if args.equal_lengths:
        lengths = [args.max_response] * args.num_seqs
    useful = sum(lengths)
    sampling = {"temperature": 1.0, "top_p": 0.95, "top_k": 50}

    with tempfile.TemporaryDirectory() as tmp:
        d = build_model_dir(Path(tmp) / "m", args.hidden, args.layers, args.vocab)

        def run_generate() -> tuple[float, float]:
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            ids = torch.tensor(prompts)
            kw = dict(do_sample=True, pad_token_id=0, **sampling)
            # Full-size warm-up: the first large allocations of a process pay page faults (glibc
            # raises its mmap threshold only after frees), which would otherwise bias the first side.
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, **kw)
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                # min_new_tokens: like ignore_eos on the engine side, every row runs to max(lengths)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max(lengths),
                                     min_new_tokens=max(lengths), **kw)
            dt = (time.perf_counter() - t0, time.process_time() - c0)
            assert out.shape[1] == args.prompt_len + max(lengths)
            return dt

        def run_engine() -> tuple[float, float]:
            engine = Engine(str(d), max_running=args.num_seqs)
            with TestClient(build_app(engine)) as c:
                c.post("/generate", json={"input_ids": prompts, "sampling_params": {"max_new_tokens": 8}})  # warm-up
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
    print(f"model: qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}; {args.num_seqs} seqs, "
          f"prompt {args.prompt_len}, responses {mix} (sum {useful} useful tokens); torch threads {args.threads}")
    print(f"transformers generate: wall {w_hf:7.2f} s ({useful / w_hf:7.1f} tok/s)  cpu {c_hf:7.2f} s ({useful / c_hf:7.1f} tok/cpu-s)")
    print(f"mrl embedded engine:   wall {w_eng:7.2f} s ({useful / w_eng:7.1f} tok/s)  cpu {c_eng:7.2f} s "
          f"({useful / c_eng:7.1f} tok/cpu-s)  decode steps {stats.get('decode_steps')}, max batch {stats.get('max_batch')}")
    ratio = c_hf / c_eng
    print(f"ratio engine/generate: {ratio:.2f}x by CPU time, {w_hf / w_eng:.2f}x by wall time")
    # Where it comes from: generate runs num_seqs rows for max(lengths) steps, the engine only the
    # useful row-steps; the rest is the cost of one row-step on each side.
    bound = args.num_seqs * max(lengths) / useful
    print(f"  = {bound:.2f}x fewer row-steps (rows retired when done) x {ratio / bound:.2f}x cheaper row-step")
    return ratio


if __name__ == "__main__":
    main()
