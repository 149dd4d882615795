"""compute_data_metrics against hand-computed values; timer; metric names."""
import pytest
import torch

from mrl.observability import (
    compute_data_metrics,
    compute_rollout_mismatch_metrics,
    names,
    timer,
)


def test_rollout_mismatch_metrics_hand_computed():
    import math
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.8, 1.0, 1.0]]))   # 0.9 sits on padding: excluded
    actor = torch.log(torch.tensor([[0.4, 0.25, 0.1], [0.9, 1.0, 1.0]]))
    m = compute_rollout_mismatch_metrics(rollout, actor, mask)
    diff = torch.tensor([0.1, 0.0, 0.1], dtype=torch.float64)
    assert m["training/rollout_probs_diff_valid"] == 1.0
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1, abs=1e-7)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.2 / 3, abs=1e-7)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(diff.std().item(), abs=1e-7)
    pr, pa = torch.tensor([0.5, 0.25, 0.8]), torch.tensor([0.4, 0.25, 0.9])
    dr, da = pr - pr.mean(), pa - pa.mean()
    want = float((dr * da).sum() / math.sqrt(float((dr * dr).sum() * (da * da).sum())))
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(want, abs=1e-6)
    # identical distributions: zero difference, correlation 1; no response token: only valid = 0
    same = compute_rollout_mismatch_metrics(rollout, rollout, mask)
    assert same["training/rollout_probs_diff_max"] == 0.0
    assert same["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert compute_rollout_mismatch_metrics(rollout, actor, torch.zeros_like(mask)) == {
        "training/rollout_probs_diff_valid": 0.0}
    with pytest.raises(ValueError, match="must match"):
        compute_rollout_mismatch_metrics(rollout[:, :2], actor, mask)


def test_data_metrics_hand_computed():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    scores = torch.tensor([[0, 0, 0, 1.0], [0, 0.5, 0, 0]])
    rewards = scores - 0.1 * mask
    adv = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, -2.0, 99.0, 99.0]])  # 99 sits on padding: excluded
    ret = adv + 1
    values = ret - torch.tensor([[0.1, -0.1, 0.1, -0.1], [0.1, -0.1, 0.0, 0.0]])
    pmask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    m = compute_data_metrics(response_mask=mask, token_level_scores=scores, token_level_rewards=rewards,
                             advantages=adv, returns=ret, values=values, prompt_mask=pmask)
    assert m["critic/score/mean"] == pytest.approx(0.75) and m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.5
    assert m["critic/rewards/mean"] == pytest.approx((0.6 + 0.3) / 2, abs=1e-6)
    assert m["critic/advantages/max"] == 4.0 and m["critic/advantages/min"] == -2.0
    assert m["critic/advantages/mean"] == pytest.approx(7 / 6)
    assert m["critic/returns/mean"] == pytest.approx(13 / 6)
    r = torch.tensor([2.0, 3, 4, 5, 0, -1])
    ev = 1 - torch.full((6,), 0.1).mul(torch.tensor([1, -1, 1, -1, 1, -1])).var(unbiased=False) / (r.var(unbiased=False) + 1e-5)
    assert m["critic/vf_explained_var"] == pytest.approx(ev.item(), abs=1e-6)
    assert (m["response_length/mean"], m["response_length/max"], m["response_length/min"]) == (3.0, 4.0, 2.0)
    assert m["response_length/clip_ratio"] == 0.5
    assert (m["prompt_length/mean"], m["prompt_length/clip_ratio"]) == (2.5, 0.5)
    assert compute_data_metrics(response_mask=mask, max_response_length=8)["response_length/clip_ratio"] == 0.0
    # Only what was given is reported.
    assert set(compute_data_metrics(response_mask=mask)) == {f"response_length/{s}" for s in ("mean", "max", "min", "clip_ratio")}


def test_timer_accumulates_and_survives_exceptions(monkeypatch):
    import importlib
    from types import SimpleNamespace

    clock = iter([10.0, 10.25, 20.0, 20.5])  # perf_counter at each block's start and end: 0.25 s, then 0.5 s
    monkeypatch.setattr(importlib.import_module("mrl.observability.timer"), "time",
                        SimpleNamespace(perf_counter=lambda: next(clock)))
    metrics: dict[str, float] = {}
    with timer("gen", metrics):
        pass
    with pytest.raises(RuntimeError), timer("gen", metrics):
        raise RuntimeError
    assert metrics["timing_s/gen"] == 0.75
    assert names.timing("update_actor") == "timing_s/update_actor" and "gen" in names.PHASES


def test_throughput_metrics():
    from mrl.observability import compute_throughput_metrics

    m = compute_throughput_metrics({"timing_s/step": 2.0, "timing_s/gen": 1.0}, num_tokens=800, num_devices=4)
    assert m == {"perf/total_num_tokens": 800.0, "perf/time_per_step": 2.0, "perf/throughput": 100.0}
    with pytest.raises(KeyError, match=r"timer\('step', metrics\)"):
        compute_throughput_metrics({}, 1, 1)
