"""On-policy distillation vs GRPO on the quickstart's task, side by side (docs/distillation.md).

For each asset seed: write the quickstart's student and the distillation teacher (`python -m mrl.quickstarts
distill --seed S`), train `mrl_configs/quickstart_distill.yaml` (the teacher's reverse KL as the only reward)
and, unless --skip-grpo, `mrl_configs/quickstart.yaml` (GRPO on the rule reward) from the same student; read
the greedy validation curves from each run's metrics.log, print a table (steps to 0.8, accuracy at chosen
steps) and plot the curves to --plot. `--variant NAME=override,...` adds runs of the distillation config with
overrides (e.g. another micro-batch split: another floating-point order).

    python benchmarks/distill_demo.py --seeds 0 1 2 --out /tmp/distill_demo --plot docs/img/distill_vs_grpo.png
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAL = re.compile(r"^step:(\d+) .*?val-core/arith/reward/mean@1:([0-9.]+)")


def val_curve(metrics_log: Path) -> list[tuple[int, float]]:
    """(step, greedy val accuracy) of a run's metrics.log (verl's metric lines)."""
    out = []
    for line in metrics_log.read_text().splitlines():
        m = VAL.match(line)
        if m:
            out.append((int(m.group(1)), float(m.group(2))))
    return out


def train(config: str, assets: Path, run_dir: Path, overrides: list[str]) -> tuple[list[tuple[int, float]], float]:
    cmd = [sys.executable, "-m", "mrl", "train", config, f"model.path={assets}/tiny-qwen2",
           f"data.train_files=[{assets}/data/train.jsonl]", f"data.val_files=[{assets}/data/val.jsonl]",
           f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]", *overrides]
    if "distill" in config:
        cmd.append(f"teacher.path={assets}/tiny-qwen2-teacher")
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    return val_curve(run_dir / "metrics.log"), time.monotonic() - t0


def first_at(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, v in curve if v >= target), None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default="/tmp/distill_demo")
    p.add_argument("--plot", default=None, help="PNG of the curves (seed of the first --seeds)")
    p.add_argument("--skip-grpo", action="store_true")
    p.add_argument("--variant", action="append", default=[], help="NAME=key=value,key=value (distillation runs)")
    args = p.parse_args()
    out = Path(args.out)
    runs: dict[tuple[str, int], tuple[list[tuple[int, float]], float]] = {}
    variants = {"distill": []} | {v.split("=", 1)[0]: v.split("=", 1)[1].split(",") for v in args.variant}
    for seed in args.seeds:
        assets = out / f"assets_{seed}"
        subprocess.run([sys.executable, "-m", "mrl.quickstarts", "distill", "--seed", str(seed), "--out", str(assets)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        for name, ov in variants.items():
            runs[name, seed] = train("mrl_configs/quickstart_distill.yaml", assets, out / f"{name}_{seed}", ov)
        if not args.skip_grpo:
            runs["grpo", seed] = train("mrl_configs/quickstart.yaml", assets, out / f"grpo_{seed}", [])
    print("| run | seed | val at 0 | first step >= 0.8 | best (step) | last | wall |")
    print("|---|---|---|---|---|---|---|")
    for (name, seed), (curve, wall) in runs.items():
        best = max(curve, key=lambda sv: sv[1])
        print(f"| {name} | {seed} | {curve[0][1]:.2f} | {first_at(curve, 0.8)} | {best[1]:.2f} ({best[0]}) | "
              f"{curve[-1][1]:.2f} ({curve[-1][0]}) | {wall:.0f} s |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        seed = args.seeds[0]
        for (name, s), (curve, _) in runs.items():
            if s == seed:
                xs, ys = zip(*curve, strict=True)
                label = {"grpo": "GRPO, rule reward (quickstart.yaml)",
                         "distill": "distillation, no task reward (quickstart_distill.yaml)"}.get(name, name)
                ax.plot(xs, ys, "o-", markersize=3, label=label)
        ax.axhline(0.8, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("step")
        ax.set_ylabel("greedy val accuracy")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        ax.set_title(f"tiny Qwen2 student, single-digit addition, asset seed {seed}", fontsize=9)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
