"""LR schedule of the trained roles (Megatron OptimizerParamScheduler driven by OptimConfig)."""
import math

import pytest
import torch

from mrl.config.optim import OptimConfig
from mrl.workers.optim import build_lr_scheduler


def _lrs(optim: OptimConfig, total: int | None, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = build_lr_scheduler(opt, optim, total_optimizer_steps=total)
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        sched.step(increment=1)
        out.append(opt.param_groups[0]["lr"])
    return out


def test_constant_linear_warmup_and_cosine_decay():
    assert _lrs(OptimConfig(lr=1e-3), None, 3) == pytest.approx([1e-3] * 4)
    warm = _lrs(OptimConfig(lr=1e-3, lr_warmup_steps=4), 10, 6)
    assert warm[:5] == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3])
    cos = _lrs(OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1), 10, 10)
    assert cos[2] == pytest.approx(1e-3)
    mid = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * 4 / 8))
    assert cos[6] == pytest.approx(mid)
    assert cos[10] == pytest.approx(1e-4)
    lin = _lrs(OptimConfig(lr=1e-3, lr_schedule="linear"), 4, 4)
    assert lin == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])


def test_decay_without_run_length_is_a_clear_error():
    with pytest.raises(ValueError, match="total_training_steps"):
        _lrs(OptimConfig(lr=1e-3, lr_schedule="cosine"), None, 1)
