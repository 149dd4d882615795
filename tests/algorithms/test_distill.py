"""mrl/algorithms/distill.py against its formulas."""
from __future__ import annotations

import pytest
import torch

from mrl.algorithms import distill_metrics, kl_penalty, reverse_kl_reward, teacher_kl


def _lp(seed: int, shape=(4, 6)) -> torch.Tensor:
    return -torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 4


def test_reverse_kl_reward_is_minus_coef_times_the_log_ratio_on_the_mask():
    s, t = _lp(0), _lp(1)
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    r = reverse_kl_reward(s, t, mask, 0.5)
    assert torch.equal(r, -0.5 * (s - t) * mask)
    assert torch.all(r[1, 3:] == 0)
    with pytest.raises(ValueError, match="coef"):
        reverse_kl_reward(s, t, mask, 0.0)


def test_teacher_equal_to_student_gives_zero_everywhere():
    s = _lp(2)
    mask = torch.ones_like(s)
    assert torch.equal(reverse_kl_reward(s, s, mask, 1.0), torch.zeros_like(s))
    for est in ("k1", "k2", "k3", "k3+"):
        assert torch.equal(teacher_kl(s, s, est), torch.zeros_like(s)), est
    m = distill_metrics(s, s, mask)
    assert m["distill/reverse_kl"] == 0.0 and m["distill/teacher_logp"] == m["distill/student_logp"]


def test_teacher_kl_is_the_reference_kl_estimators_with_the_teacher_in_its_place():
    s, t = _lp(3), _lp(4)
    for est in ("kl", "mse", "low_var_kl", "low_var_kl+"):
        assert torch.equal(teacher_kl(s, t, est), kl_penalty(s, t, est))
    d = s - t
    torch.testing.assert_close(teacher_kl(s, t, "k3"), torch.clamp(torch.exp(-d) + d - 1, -10, 10))


def test_metrics_are_token_means_over_the_mask():
    s, t = _lp(5), _lp(6)
    mask = torch.zeros_like(s)
    mask[:, :2] = 1
    m = distill_metrics(s, t, mask)
    assert m["distill/reverse_kl"] == pytest.approx(float((s - t)[:, :2].mean()), rel=1e-6)
    assert m["distill/teacher_logp"] == pytest.approx(float(t[:, :2].mean()), rel=1e-6)
