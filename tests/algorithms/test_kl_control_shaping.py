"""KL controllers, KL penalty in the reward (verl's apply_kl_penalty), reward-shaping schedules, blend and bonus (docs/driver.md)."""
import itertools

import pytest
import torch

from mrl.algorithms import (
    SCHEDULES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    blend_ref_reward,
    get_kl_controller,
    repr_align_bonus,
    schedule_weight,
)


def test_apply_kl_penalty_seed_002_example():
    old = torch.tensor([[-0.12, -0.08, -0.15, -0.10, -0.05, -0.02]], dtype=torch.float64)
    ref = torch.tensor([[-0.15, -0.10, -0.18, -0.12, -0.08, -0.03]], dtype=torch.float64)
    scores = torch.tensor([[0, 0, 0, 0, 0, 1.0]], dtype=torch.float64)
    ctrl = FixedKLController(0.1)
    rewards, metrics = apply_kl_penalty(scores, old, ref, torch.ones_like(old), ctrl, "kl")
    want = torch.tensor([[-0.003, -0.002, -0.003, -0.002, -0.003, 0.999]], dtype=torch.float64)
    torch.testing.assert_close(rewards, want, rtol=0, atol=1e-12)
    assert metrics["critic/kl"] == pytest.approx(0.14 / 6, rel=1e-9)
    assert metrics["critic/kl_coeff"] == 0.1 and ctrl.value == 0.1


def test_apply_kl_penalty_masks_and_averages_per_sequence():
    old = torch.tensor([[0.5, 0.5, 9.0], [0.1, 0.3, 0.2]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards, metrics = apply_kl_penalty(torch.zeros(2, 3), old, ref, mask, FixedKLController(1.0), "k1")
    assert rewards[0, 2].item() == 0.0  # padding is not penalised
    assert metrics["critic/kl"] == pytest.approx((0.5 + 0.2) / 2)


def test_adaptive_controller_moves_toward_target_and_clips():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    c.update(current_kl=0.06, n_steps=10)  # err = 0.2 -> *1.02
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    c2 = AdaptiveKLController(0.1, 0.05, 100)
    c2.update(current_kl=5.0, n_steps=10)  # err clipped to 0.2
    assert c2.value == pytest.approx(0.102)
    c3 = AdaptiveKLController(0.1, 0.05, 100)
    c3.update(current_kl=0.0, n_steps=10)  # err clipped to -0.2
    assert c3.value == pytest.approx(0.098)
    s = c3.state_dict()
    c4 = AdaptiveKLController(1.0, 1.0, 1.0)
    c4.load_state_dict(s)
    assert c4.state_dict() == s
    _rewards, m = apply_kl_penalty(torch.zeros(1, 2), torch.full((1, 2), 0.5), torch.zeros(1, 2), torch.ones(1, 2), c4, "kl")
    assert m["critic/kl_coeff"] == pytest.approx(0.098) and c4.value == pytest.approx(0.098 * (1 + 0.2 * 1 / 100))


def test_kl_controller_factory_errors():
    assert isinstance(get_kl_controller("fixed", 0.01), FixedKLController)
    assert isinstance(get_kl_controller("adaptive", 0.01, 0.1, 1000), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl"):
        get_kl_controller("adaptive", 0.01)
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        get_kl_controller("pid", 0.01)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, 0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_endpoints_and_monotone(schedule):
    total, warm = 100, 0.7
    ws = [schedule_weight(schedule, s, total, 0.6, warm, steps=3) for s in range(total + 1)]
    assert ws[0] == 0.0
    assert ws[70] == pytest.approx(0.6, abs=1e-12) and all(w == pytest.approx(0.6) for w in ws[70:])
    assert all(b >= a - 1e-15 for a, b in itertools.pairwise(ws))
    assert all(0.0 <= w <= 0.6 + 1e-12 for w in ws)


def test_schedule_shapes_and_step_counts():
    f = {s: schedule_weight(s, 35, 100, 1.0, 0.7, steps=3) for s in SCHEDULES}  # half-way through warm-up
    assert f["linear"] == pytest.approx(0.5)
    assert f["sigmoid"] == pytest.approx(0.5) and f["cosine"] == pytest.approx(0.5)
    assert f["exp"] < 0.1  # exponential: very slow start
    assert schedule_weight("sigmoid", 7, 100, 1.0, 0.7) < schedule_weight("linear", 7, 100, 1.0, 0.7)
    for steps in (1, 3, 5):
        vals = {schedule_weight("step", s, 100, 1.0, 0.7, steps=steps) for s in range(101)}
        assert sorted(vals) == pytest.approx([k / steps for k in range(steps + 1)])
    assert schedule_weight("linear", 0, 10, 0.5, 0.0) == 0.5  # no warm-up
    with pytest.raises(ValueError, match="schedule"):
        schedule_weight("quadratic", 1, 10, 1.0, 0.5)
    with pytest.raises(ValueError, match="warmup_ratio"):
        schedule_weight("linear", 1, 10, 1.0, 1.5)


def test_blend_ref_reward_minmax_per_sequence_and_constant_case():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.0, -3.0, -2.0, -100.0], [-0.5, -0.5, 7.0, 7.0], [-1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])
    out = blend_ref_reward(rewards, ref, mask, weight=0.25)
    assert out.shape == rewards.shape
    norm0 = torch.tensor([1.0, 0.0, 0.5, 0.0])  # min -3, max -1 over valid tokens; padding ignored
    torch.testing.assert_close(out[0], 0.75 * rewards[0] + 0.25 * norm0)
    torch.testing.assert_close(out[1], 0.75 * rewards[1])  # constant sequence -> no ref signal
    torch.testing.assert_close(out[2], 0.75 * rewards[2])  # single token -> no ref signal
    torch.testing.assert_close(blend_ref_reward(rewards, ref, mask, 0.0), rewards)
    with pytest.raises(ValueError, match="max_weight"):
        blend_ref_reward(rewards, ref, mask, 1.5)


def test_repr_align_bonus():
    sim = torch.tensor([0.8, -0.5, 0.3])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    b = repr_align_bonus(sim, mask, weight=0.2)
    assert b.shape == mask.shape
    torch.testing.assert_close(b[0], torch.full((4,), 0.2 * 0.8 / 4))
    torch.testing.assert_close(b[1], torch.tensor([-0.05, -0.05, 0.0, 0.0]))
    torch.testing.assert_close(b.sum(-1), torch.tensor([0.16, -0.1, 0.0]))
    with pytest.raises(ValueError, match="similarity"):
        repr_align_bonus(sim[:2], mask, 0.2)
