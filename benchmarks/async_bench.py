"""max_staleness 0 vs 1 vs 2 side by side: step time, tokens/s and the learning curve per step.

The quickstart task (warm-started tiny Qwen2, single-digit addition, GRPO 32 prompts x n=8, lr 1e-3)
with the engine on its own device (``rollout.placement=separate``: one trainer rank, one engine;
on this CPU host each is a process, one core's worth each when the host is otherwise idle). The
three schedules run one after the other, ``--rounds`` times interleaved (0, 1, 2, 0, 1, 2, ...), so
host load from other jobs hits all of them alike; every run starts Ray, the rank and the engine
anew. Reported per schedule: median of the per-step ``timing_s/step`` (steps 2.. ; step 1 waits for
the first batch in every schedule), tokens/s (prompt + response tokens trained per second of step
time), the producer's generation time, and ``critic/score/mean`` (sampled reward) per step. The
per-phase times of the synchronous runs are written for benchmarks/async_sim.py.

    .venv/bin/python benchmarks/async_bench.py --out outputs/async_bench [--steps 30 --rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "sync_weights")


def _metrics(db: Path) -> dict[str, dict[int, float]]:
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT key, step, value FROM metrics").fetchall()
    out: dict[str, dict[int, float]] = {}
    for k, s, v in rows:
        out.setdefault(k, {})[s] = v
    return out


def run_one(k: int, out: Path, assets: Path, steps: int, port: int, extra: list[str]) -> dict:
    d = out / f"k{k}_{int(time.time())}"
    d.mkdir(parents=True)
    cmd = [sys.executable, "-m", "mrl", "train", "mrl_configs/quickstart.yaml", f"model.path={assets}/tiny-qwen2",
           f"data.train_files=[{assets}/data/train.jsonl]", "data.val_files=[]", f"trainer.total_training_steps={steps}",
           "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0",
           f"trainer.mlflow_tracking_uri=sqlite:///{d}/mlflow.db", f"trainer.default_local_dir={d}/ckpt",
           f"rollout.port_base={port}", "rollout.placement=separate", "rollout.num_engines=1",
           "cluster.n_gpus_per_node=2", "rollout.weight_sync.transport=distributed",
           "actor.optim.lr_schedule=constant", "rollout.n=8",  # the settings docs/async.md was measured with
           f"trainer.async_training.max_staleness={k}", *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
                       env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"k={k} failed:\n{p.stderr[-4000:]}")
    m = _metrics(d / "mlflow.db")
    step_s = [m["timing_s/step"][s] for s in sorted(m["timing_s/step"]) if s > 1]
    tokens = [m["perf/total_num_tokens"][s] for s in sorted(m["timing_s/step"]) if s > 1]
    phases = {ph: statistics.median(m[f"timing_s/{ph}"][s] for s in m[f"timing_s/{ph}"] if s > 1)
              for ph in PHASES if f"timing_s/{ph}" in m}
    gen = m.get("async/producer_gen_s", m.get("timing_s/gen", {}))
    return {"k": k, "wall_s": wall, "step_s_median": statistics.median(step_s), "step_s_mean": statistics.fmean(step_s),
            "tokens_per_s": sum(tokens) / sum(step_s), "producer_gen_s": statistics.median(gen.values()),
            "phases": phases, "score": [m["critic/score/mean"][s] for s in sorted(m["critic/score/mean"])],
            "staleness_mean": statistics.fmean(m.get("async/staleness/mean", {0: 0.0}).values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "async_bench")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--port", type=int, default=27100)
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    assets = a.out / "assets"
    if not (assets / "tiny-qwen2").is_dir():  # the warm-started quickstart model (learning needs it)
        subprocess.run([sys.executable, "-m", "mrl.quickstarts", "base", "--out", str(assets)], cwd=ROOT, check=True)
    runs = []
    for r in range(a.rounds):
        for k in a.staleness:
            res = run_one(k, a.out, assets, a.steps, a.port + 10 * k + 100 * r, a.extra)
            res["round"] = r
            runs.append(res)
            print(json.dumps({x: res[x] for x in ("k", "round", "wall_s", "step_s_median", "tokens_per_s",
                                                   "producer_gen_s", "staleness_mean")}), flush=True)
    (a.out / "results.json").write_text(json.dumps(runs, indent=1))
    print("\n| max_staleness | step s (median) | tokens/s | producer gen s | staleness | score steps 1-5 | score last 5 | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for k in a.staleness:
        rs = [x for x in runs if x["k"] == k]
        first = statistics.fmean(v for x in rs for v in x["score"][:5])
        last = statistics.fmean(v for x in rs for v in x["score"][-5:])
        def col(key: str, fmt: str, rs: list = rs) -> str:
            return " / ".join(format(x[key], fmt) for x in rs)
        print(f"| {k} | {col('step_s_median', '.2f')} | {col('tokens_per_s', '.0f')} | {col('producer_gen_s', '.2f')} | "
              f"{statistics.fmean(x['staleness_mean'] for x in rs):.2f} | {first:.3f} | {last:.3f} | {col('wall_s', '.0f')} |")
    print("\nscore per step (mean over rounds):")
    for k in a.staleness:
        rs = [x for x in runs if x["k"] == k]
        curve = [statistics.fmean(x["score"][s] for x in rs) for s in range(min(len(x["score"]) for x in rs))]
        print(f"k={k}: " + " ".join(f"{v:.2f}" for v in curve))


if __name__ == "__main__":
    main()
