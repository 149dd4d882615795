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


def test_resume_with_a_longer_run_rebuilds_the_schedule():
    # issue 19: the checkpoint's decay length won, so a run resumed with more steps sat at min_lr
    optim = OptimConfig(lr=1e-3, lr_schedule="cosine", min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    old = build_lr_scheduler(opt, optim, total_optimizer_steps=4)
    for _ in range(4):
        old.step(increment=1)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)  # the end of the short schedule
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    new = build_lr_scheduler(opt2, optim, total_optimizer_steps=8)
    new.load_state_dict(old.state_dict())
    assert new.num_steps == 4
    assert opt2.param_groups[0]["lr"] == pytest.approx(_lrs(optim, 8, 4)[4])  # step 4 of the 8-step schedule
    new.step(increment=1)
    assert opt2.param_groups[0]["lr"] == pytest.approx(_lrs(optim, 8, 5)[5])


def _fused_rank(rank, world, path):
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import grouped_batch

    out = {}
    for run in ("fused", "fused_again", "loop"):
        a = ActorWorker(ActorConfig(ppo_micro_batch_size_per_gpu=16, optim={"lr": 1e-2}), model_path=path,
                        mini_batch_size_samples=16, seed=1)
        groups = [g for o in getattr(a.optimizer, "chained_optimizers", [a.optimizer]) for g in o.optimizer.param_groups]
        out[f"flags_{run}"] = [(g["fused"], g["foreach"]) for g in groups]
        if run == "loop":
            for g in groups:
                g["fused"], g["foreach"] = False, False
        out["start"] = torch.cat([p.detach().flatten() for c in a.model.chunks for p in c.parameters()]).numpy().copy()
        for i in range(3):
            a.update_policy(grouped_batch())
            if i == 0:
                out[f"{run}_1"] = torch.cat([p.detach().flatten() for c in a.model.chunks for p in c.parameters()]).numpy()
        out[run] = torch.cat([p.detach().flatten() for c in a.model.chunks for p in c.parameters()]).numpy()
        del a
    return out


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_cpu_adam_is_fused_reproducible_and_equal_to_the_single_tensor_loop(tmp_path):
    import numpy as np

    from tests.helpers.dist import run_ranks
    from tests.helpers.tiny_models import make_tiny_hf

    out = run_ranks(_fused_rank, 1, args=(str(make_tiny_hf(tmp_path / "m", "qwen2")),), timeout_s=240)[0]
    assert set(out["flags_fused"]) == {(True, False)}  # build_optimizer chose the fused kernel for CPU params
    moved = np.abs(out["fused"] - out["start"]).max()
    assert moved > 1e-3  # the steps moved the weights
    assert np.array_equal(out["fused"], out["fused_again"])  # bitwise run to run, over 3 steps
    # One step from the same weights and gradients: the loop's arithmetic in another order, float32
    # rounding (weights are O(0.1), one step moves them by up to lr = 1e-2). Later steps feed those
    # last-bit differences back through the gradients, and Adam's normalised update amplifies them.
    # The bound is in units in the last place of each weight: RMSNorm weights sit at 1.0, where one float32
    # ulp is 1.19e-7 (an absolute 1e-7 held for one gradient and not for the sdpa backend's, rounded differently).
    step = np.abs(out["loop_1"] - out["start"]).max()
    # Near 0 the update's own rounding dominates: one step is at most lr = 1e-2, whose float32 ulp is 9.3e-10.
    ulp = np.maximum(np.spacing(np.abs(out["loop_1"]).astype(np.float32)), np.spacing(np.float32(1e-2)))
    ulps = np.abs(out["fused_1"] - out["loop_1"]) / ulp
    assert step > 1e-3 and ulps.max() <= 2, ulps.max()
