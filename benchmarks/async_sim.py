"""Expected speed-up of the off-policy schedule at 8 and 64 GPUs, simulated from measured phase times.

Inputs (from ``benchmarks/async_bench.py``'s synchronous runs, ``--from OUT_DIR``; or given by hand):
``G`` = device-seconds to generate one batch (the producer's generation time on the run's one engine
device), ``T`` = device-seconds of one training step without generation and push (reward,
log-probs, reference, advantages, update on the run's one trainer device), ``S`` = seconds of one
weight push, ``cv`` = coefficient of variation of the per-batch generation time (response lengths vary).

Model, per step on N devices (a discrete-event simulation of ``--steps`` steps, same draws for every
schedule):
* generation of a batch on ``E`` engine devices takes ``g = G / E * X + F``, X ~ log-normal (mean 1,
  ``cv``), F = ``--floor`` seconds that do not shrink with more engines (the longest sample's decode
  latency: the long tail); training takes ``T / D`` on ``D`` trainer devices (perfect data-parallel
  scaling: optimistic for the trainer, so the gains below are not inflated by it);
* ``sync colocated`` (verl's hybrid engine, mrl's default): every device generates, then trains:
  ``g(N) + T/N + S`` per step;
* ``sync separate``: E + D = N, generate then train, the other side idle: ``g(E) + T/D + S``;
* ``async k`` (separate): the producer generates batch i once step i - k has pushed; the trainer
  trains batch i once it is ready; without partial rollouts a push waits for the batch being
  generated to finish (mrl/driver/async_rollout.py), with them it interrupts it (the batch takes S
  longer) and the trainer goes on.
The split E/D is chosen per schedule to minimise its step time (the best each can do).

    python benchmarks/async_sim.py --from outputs/async_bench            # measured inputs
    python benchmarks/async_sim.py --G 1.0 --T 1.0 --S 0.05 --cv 0.3 --floor 0.2
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sqlite3
import statistics
from pathlib import Path


def measured(out: Path) -> dict[str, float]:
    """G, T, S and cv from the max_staleness=0 runs of async_bench.py under ``out``."""
    runs = [r for r in json.loads((out / "results.json").read_text()) if r["k"] == 0]
    if not runs:
        raise SystemExit(f"{out}/results.json has no max_staleness=0 run; run benchmarks/async_bench.py first")
    ph = {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]}
    gens: list[float] = []
    for db in sorted(out.glob("k0_*/mlflow.db")):
        with sqlite3.connect(db) as c:
            gens += [v for s, v in c.execute("SELECT step, value FROM metrics WHERE key='timing_s/gen'") if s > 1]
    step = statistics.median(r["step_s_median"] for r in runs)
    return {"G": ph["gen"], "S": ph.get("sync_weights", 0.0), "T": step - ph["gen"] - ph.get("sync_weights", 0.0),
            "cv": statistics.pstdev(gens) / statistics.fmean(gens) if len(gens) > 1 else 0.0}


def draws(steps: int, cv: float, seed: int) -> list[float]:
    """Per-batch generation-time multipliers, log-normal with mean 1 and the given cv."""
    rng = random.Random(seed)
    s2 = math.log(1 + cv * cv)
    return [rng.lognormvariate(-s2 / 2, math.sqrt(s2)) for _ in range(steps)]


def simulate(gen: float, train: float, push: float, xs: list[float], floor: float, k: int, partial: bool) -> float:
    """Mean step time (second half of the steps) of the producer/consumer pipeline; k = 0 is the
    synchronous loop (batch i starts once step i - 1 has pushed), which is also how ``sync
    colocated`` runs when gen and train are the whole machine's times."""
    n, inf = len(xs), math.inf
    now, ready, done_at = 0.0, set(), []
    eng_busy, eng_end, eng_batch, next_batch = False, inf, -1, 0
    tr, tr_end, step, pending = "wait", inf, 0, False  # trainer: wait | train | want_push | push
    while step < n:
        if not eng_busy and next_batch < n and step >= next_batch - k and not pending:
            eng_busy, eng_batch, eng_end = True, next_batch, now + gen * xs[next_batch] + floor
            next_batch += 1
        if tr == "wait" and step in ready:
            ready.remove(step)
            tr, tr_end = "train", now + train
        if tr == "want_push" and (partial or not eng_busy):  # without partial rollouts: after the batch
            tr, tr_end = "push", now + push
            if partial and eng_busy:
                eng_end += push  # the batch in flight is paused for the push, then continued
        now = min(eng_end if eng_busy else inf, tr_end if tr in ("train", "push") else inf)
        if eng_busy and eng_end <= now:
            ready.add(eng_batch)
            eng_busy, eng_end = False, inf
        if tr == "train" and tr_end <= now:
            tr, pending = "want_push", True
        elif tr == "push" and tr_end <= now:
            tr, pending, step = "wait", False, step + 1
            done_at.append(now)
    half = n // 2
    return (done_at[-1] - done_at[half - 1]) / (n - half)


def best_split(n: int, fn) -> tuple[float, int]:
    """(step time, engine devices) minimising fn(engine devices, trainer devices)."""
    return min((fn(e, n - e), e) for e in range(1, n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", type=Path, help="async_bench.py output directory (measured inputs)")
    ap.add_argument("--G", type=float, help="device-seconds of generation per batch")
    ap.add_argument("--T", type=float, help="device-seconds of training per step (no generation, no push)")
    ap.add_argument("--S", type=float, help="seconds per weight push")
    ap.add_argument("--cv", type=float, help="coefficient of variation of the generation time")
    ap.add_argument("--floor", type=float, default=0.0, help="seconds of generation per batch that more engines do not "
                    "shorten (long tail); default 0 = perfect scaling")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    p = measured(a.src) if a.src else {}
    for k in ("G", "T", "S", "cv"):
        if getattr(a, k) is not None:
            p[k] = getattr(a, k)
        if k not in p:
            raise SystemExit(f"--{k} missing (or give --from an async_bench.py output directory)")
    G, T, S, cv = p["G"], p["T"], p["S"], p["cv"]
    xs = draws(a.steps, cv, a.seed)
    print(f"inputs: G={G:.3f} device-s  T={T:.3f} device-s  S={S:.3f} s  cv={cv:.2f}  floor={a.floor:.3f} s")
    print("| devices | schedule | engine/trainer devices | step s | speed-up vs sync colocated | vs sync separate |")
    print("|---|---|---|---|---|---|")
    for n in a.gpus:
        base = simulate(G / n, T / n, S, xs, a.floor, 0, False)
        sep, e_sep = best_split(n, lambda e, d: simulate(G / e, T / d, S, xs, a.floor, 0, False))
        rows = [("sync colocated", f"{n}/{n}", base), ("sync separate", f"{e_sep}/{n - e_sep}", sep)]
        for k in (1, 2):
            for partial in (False, True):
                st, e = best_split(n, lambda e, d, k=k, partial=partial: simulate(G / e, T / d, S, xs, a.floor, k, partial))
                rows.append((f"async k={k}{' + partial' if partial else ''}", f"{e}/{n - e}", st))
        for name, split, st in rows:
            print(f"| {n} | {name} | {split} | {st:.4f} | {base / st:.2f}x | {sep / st:.2f}x |")


if __name__ == "__main__":
    main()
