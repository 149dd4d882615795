"""benchmarks/distill_demo.py's readers: the validation curve from verl's metric lines and the step it first
reaches a target (the training runs themselves are the benchmark's, not a test's)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("distill_demo", ROOT / "benchmarks" / "distill_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_val_curve_and_first_step_at_a_target(tmp_path) -> None:
    m = _module()
    log = tmp_path / "metrics.log"
    log.write_text("step:0 - val-core/arith/reward/mean@1:0.31\n"
                   "step:1 - actor/entropy:0.8 - critic/score/mean:0.2\n"
                   "step:10 - actor/lr:0.001 - val-core/arith/reward/mean@1:0.79\n"
                   "step:20 - val-core/arith/reward/mean@1:0.81 - x:1\n")
    curve = m.val_curve(log)
    assert curve == [(0, 0.31), (10, 0.79), (20, 0.81)]
    assert m.first_at(curve, 0.8) == 20 and m.first_at(curve, 0.9) is None
