"""What a person watches while a run learns: a progress line per step, the learning curves at the end.

The progress line (``step 12/300 | score 0.41 | val 0.52 @10 | 0.42 s/step | ETA 2m01s``) goes to
stderr as plain lines, so it shows in a log file or a CI console as well as on a TTY (tqdm's bar
showed only on a TTY). Lines are throttled to one per ``min_interval_s`` unless something new
happened (a validation, the last step). verl's full metric line goes to ``<run dir>/metrics.log``
(and to the ``mrl.metrics`` logger at DEBUG level): ``ConsoleSink`` in tracking.py.

The curves (``critic/score/mean``, the val score, ``actor/entropy``) are kept as they are logged and
drawn into ``<run dir>/learning_curve.png`` (matplotlib, Agg: no display needed), which the MLflow
sink also stores as an artifact of the run.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

SCORE = "critic/score/mean"
ENTROPY = "actor/entropy"
STEP_TIME = "timing_s/step"
VAL_PREFIX = "val-core/"


def val_score(metrics: Mapping[str, float]) -> float | None:
    """The headline validation number: the first (sorted) ``val-core/*/mean@k`` metric, None if absent."""
    keys = sorted(k for k in metrics if k.startswith(VAL_PREFIX) and "/mean@" in k)
    return float(metrics[keys[0]]) if keys else None


def format_duration(s: float) -> str:
    if not math.isfinite(s) or s < 0:
        return "?"
    s = round(s)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


class Progress:
    """Prints ``step i/N | score | val @step | s/step | ETA`` lines; ``update`` once per logged step."""

    def __init__(self, total: int, start_step: int = 0, stream: TextIO | None = None, min_interval_s: float = 2.0,
                 clock=time.monotonic) -> None:
        self.total, self.start = total, start_step
        self.stream = stream
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.t0 = clock()
        self.last_print = -math.inf
        self.val: tuple[int, float] | None = None
        self.step_times: list[float] = []

    def line(self, step: int, metrics: Mapping[str, float]) -> str:
        parts = [f"step {step}/{self.total}"]
        if SCORE in metrics:
            parts.append(f"score {metrics[SCORE]:.3f}")
        if self.val is not None:
            parts.append(f"val {self.val[1]:.3f} @{self.val[0]}")
        if self.step_times:
            recent = self.step_times[-10:]
            parts.append(f"{sum(recent) / len(recent):.2f} s/step")
        done = step - self.start
        if done > 0 and step < self.total:
            parts.append(f"ETA {format_duration((self.clock() - self.t0) / done * (self.total - step))}")
        elif step >= self.total:
            parts.append(f"done in {format_duration(self.clock() - self.t0)}")
        return " | ".join(parts)

    def update(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """Record ``metrics`` of ``step``; print (and return) the line when it is due."""
        v = val_score(metrics)
        new_val = v is not None
        if new_val:
            self.val = (step, v)
        if STEP_TIME in metrics:
            self.step_times.append(float(metrics[STEP_TIME]))
        now = self.clock()
        if not (new_val or step >= self.total or now - self.last_print >= self.min_interval_s):
            return None
        self.last_print = now
        text = self.line(step, metrics)
        print(text, file=self.stream or sys.stderr, flush=True)
        return text


class Curves:
    """The learning curves of a run, kept as logged: {name: [(step, value)]}."""

    def __init__(self) -> None:
        self.series: dict[str, list[tuple[int, float]]] = {"score": [], "val": [], "entropy": []}

    def add(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in (("score", metrics.get(SCORE)), ("val", val_score(metrics)),
                            ("entropy", metrics.get(ENTROPY))):
            if value is not None and math.isfinite(float(value)):
                self.series[name].append((step, float(value)))

    def plot(self, path: str | Path, title: str = "") -> Path | None:
        """Score and val (left axis), entropy (right axis) against the step, to ``path`` (PNG); None when
        nothing was logged."""
        if not any(self.series.values()):
            return None
        import matplotlib

        matplotlib.use("Agg")  # no display: a file, in any process
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for name, style in (("score", "-"), ("val", "o-")):
            if self.series[name]:
                xs, ys = zip(*self.series[name], strict=True)
                ax.plot(xs, ys, style, label=f"{name} ({'sampled' if name == 'score' else 'greedy val'})", markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.set_ylim(-0.02, 1.02) if all(0 <= v <= 1 for s in ("score", "val") for _, v in self.series[s]) else None
        handles, labels = ax.get_legend_handles_labels()
        if self.series["entropy"]:
            ax2 = ax.twinx()
            xs, ys = zip(*self.series["entropy"], strict=True)
            ax2.plot(xs, ys, "-", color="tab:gray", alpha=0.6, label="entropy")
            ax2.set_ylabel("entropy (nats/token)")
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, loc="lower right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path
