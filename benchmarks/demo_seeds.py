"""Does a CPU quickstart hold? Run it over asset seeds and floating-point orders, print its curve (issue 32).

For each asset seed: write the demo's assets (`python -m mrl.quickstarts DEMO --seed S --out OUT/assets_S`),
then train the config with its `outputs/quickstart*/` paths pointed at those assets, once per variant:
`default` (the config as shipped) and each `--variant NAME=key=value,key=value` (e.g. another
`actor.ppo_micro_batch_size_per_gpu`: the same samples summed in another order, what another CPU does). Reads
the validation metric from each run's metrics.log and prints a markdown table (value at the chosen steps,
first step at the target, wall time, `uptime` before and after).

    python benchmarks/demo_seeds.py mrl_configs/quickstart_lora.yaml --demo base --seeds 0 1 2 \\
        --variant mb32=actor.ppo_micro_batch_size_per_gpu=32 --only-variant-seed 0 --port-base 31000
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSET_PATH = re.compile(r"outputs/quickstart(?:_[a-z]+)*/")


def curve(metrics_log: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of `metric` in a run's metrics.log (one `step:N key:value ...` line per step)."""
    pat = re.compile(r"^step:(\d+) .*?" + re.escape(metric) + r":(-?[0-9.]+)")
    out = []
    for line in metrics_log.read_text().splitlines() if metrics_log.exists() else []:
        m = pat.match(line)
        if m:
            out.append((int(m.group(1)), float(m.group(2))))
    return out


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def train(config: Path, run_dir: Path, overrides: list[str], port_base: int) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "mrl", "train", str(config), f"trainer.default_local_dir={run_dir}",
           "trainer.logger=[console]", f"rollout.port_base={port_base}", *overrides]
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(run_dir / "train.log", "w") as log:
        rc = subprocess.run(cmd, check=False, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=7200,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
    if rc != 0:
        print(f"  exit {rc}: see {run_dir / 'train.log'}", flush=True)
    return time.monotonic() - t0, f"rc={rc}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--demo", default="base", help="python -m mrl.quickstarts DEMO writes the assets")
    p.add_argument("--demo-arg", action="append", default=[], help="passed to the asset script, e.g. --demo-arg=--force")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variant", action="append", default=[], help="NAME=key=value,key=value")
    p.add_argument("--only-variant-seed", type=int, nargs="*", default=None,
                   help="run the variants on these seeds only (default: every seed)")
    p.add_argument("--no-default", action="store_true", help="skip the shipped config (variants only)")
    p.add_argument("--set", action="append", default=[], help="key=value applied to every run")
    p.add_argument("--metric", default="val-core/arith/reward/mean@1")
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--steps", type=int, nargs="*", default=None, help="steps shown (default: every logged one)")
    p.add_argument("--out", default="/tmp/demo_seeds")
    p.add_argument("--port-base", type=int, default=31000, help="rollout.port_base of the first run (+20 each)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = (ROOT / args.config).read_text()
    variants = ({} if args.no_default else {"default": []}) | {
        v.split("=", 1)[0]: [o for o in v.split("=", 1)[1].split(",") if o] for v in args.variant}
    rows = []
    port = args.port_base
    for seed in args.seeds:
        assets = out / f"assets_{seed}"
        with open(out / f"assets_{seed}.log", "a") as log:  # the asset script's status (e.g. the warm start's loss)
            rc = subprocess.run([sys.executable, "-m", "mrl.quickstarts", args.demo, "--seed", str(seed), "--out",
                                 str(assets), *args.demo_arg], cwd=ROOT, check=False, stdout=log,
                                stderr=subprocess.STDOUT, timeout=3600, env={**os.environ, "PYTHONPATH": str(ROOT)}).returncode
        if rc != 0:  # e.g. a judge below its target: the script refuses to write it (its last line says why)
            print(f"seed {seed}: assets not written (exit {rc}): "
                  f"{(out / f'assets_{seed}.log').read_text().strip().splitlines()[-1]}", flush=True)
            continue
        config = out / f"{Path(args.config).stem}_seed{seed}.yaml"
        config.write_text(ASSET_PATH.sub(f"{assets}/", text))
        for name, ov in variants.items():
            if name != "default" and args.only_variant_seed is not None and seed not in args.only_variant_seed:
                continue
            run_dir = out / f"{name}_{seed}"
            before = load()
            wall, rc = train(config, run_dir, [*args.set, *ov], port)
            port += 20
            c = curve(run_dir / "metrics.log", args.metric)
            rows.append((name, seed, c, wall, before, load(), rc))
            print(f"{name} seed {seed}: {c} wall {wall:.0f}s load {before} -> {load()} {rc}", flush=True)
    steps = args.steps or sorted({s for r in rows for s, _ in r[2]})
    print(f"\n{args.config}, {args.metric}" + (f", set {args.set}" if args.set else ""))
    print("| run | seed | " + " | ".join(str(s) for s in steps) + f" | first ≥ {args.target} | wall | load (1-min) |")
    print("|---|---|" + "---|" * len(steps) + "---|---|---|")
    for name, seed, c, wall, before, after, _ in rows:
        d = dict(c)
        first = next((s for s, v in c if v >= args.target), None)
        vals = " | ".join(f"{d[s]:.2f}" if s in d else "–" for s in steps)
        print(f"| {name} | {seed} | {vals} | {first} | {wall:.0f} s | {before} → {after} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
