"""The console progress line and the learning-curve PNG (mrl/observability/progress.py)."""
from __future__ import annotations

import io

from mrl.observability.progress import Curves, Progress, format_duration, val_score


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_line_has_step_score_val_step_time_and_eta_without_a_tty() -> None:
    out, clock = io.StringIO(), Clock()
    p = Progress(10, stream=out, min_interval_s=5.0, clock=clock)
    assert p.update(0, {"val-core/arith/reward/mean@1": 0.3}) == "step 0/10 | val 0.300 @0"
    clock.t = 2.0
    line = p.update(1, {"critic/score/mean": 0.25, "timing_s/step": 2.0})
    assert line is None  # throttled: nothing new within min_interval_s
    clock.t = 6.0
    line = p.update(2, {"critic/score/mean": 0.5, "timing_s/step": 4.0})
    assert line == "step 2/10 | score 0.500 | val 0.300 @0 | 3.00 s/step | ETA 24s"  # 6 s for 2 steps, 8 to go
    clock.t = 7.0
    assert p.update(3, {"val-core/arith/reward/mean@1": 0.5}).endswith("val 0.500 @3 | 3.00 s/step | ETA 16s")
    clock.t = 8.0
    assert p.update(10, {}).endswith("done in 8s")
    assert out.getvalue().splitlines()[-1].endswith("done in 8s") and len(out.getvalue().splitlines()) == 4


def test_val_score_and_durations() -> None:
    assert val_score({"val-core/b/reward/mean@1": 0.2, "val-core/a/reward/mean@4": 0.7, "val-aux/x": 1}) == 0.7
    assert val_score({"critic/score/mean": 1.0}) is None
    assert [format_duration(s) for s in (5, 65, 3700, float("nan"))] == ["5s", "1m05s", "1h01m", "?"]


def test_the_curves_are_drawn_into_a_png(tmp_path) -> None:
    c = Curves()
    assert c.plot(tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    c.add(0, {"val-core/arith/reward/mean@1": 0.3})
    for s in range(1, 6):
        c.add(s, {"critic/score/mean": 0.1 * s, "actor/entropy": 1.0 / s, "val-core/arith/reward/mean@1": 0.3 + 0.1 * s})
    assert [len(v) for v in c.series.values()] == [5, 6, 5]
    path = c.plot(tmp_path / "run" / "learning_curve.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
