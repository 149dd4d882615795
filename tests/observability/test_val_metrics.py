"""verl-named validation metrics: exact mean/std, bootstrap best/worst/maj against brute force.

Bootstrap tolerance: B = 1000 draws; an estimated mean must be within 4 standard errors
(4·σ/√B ≈ 0.13·σ) of the exact expectation, an estimated std within 4 of its own standard errors
(√((μ4 − σ⁴)/B) / (2σ), μ4 the exact 4th central moment); a miss has probability < 1e-4. The
draws are seeded, so a pass is reproducible, and a wrong reduction (max vs min, no replacement,
wrong k) moves the mean by far more than that for the cases below.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from mrl.observability.val_metrics import (
    N_BOOTSTRAP,
    majority_value,
    majority_values,
    process_validation_metrics,
    prompt_metrics,
    subset_sizes,
    validation_metric_dict,
)


def _moments(probs, xs):
    """(mean, std, 4th central moment) of a discrete distribution."""
    p, x = np.asarray(probs, dtype=np.float64), np.asarray(xs, dtype=np.float64)
    mu = float((p * x).sum())
    return mu, float(np.sqrt((p * (x - mu) ** 2).sum())), float((p * (x - mu) ** 4).sum())


def _exact(values, k, reduce):
    """Moments of reduce(draw) over ALL N^k ordered draws with replacement (equally likely)."""
    r = np.array([reduce(t) for t in itertools.product(values, repeat=k)], dtype=np.float64)
    return _moments(np.full(len(r), 1 / len(r)), r)


def _close(est_mean, est_std, exact_mean, exact_std, mu4):
    se = exact_std / math.sqrt(N_BOOTSTRAP)
    assert abs(est_mean - exact_mean) <= 4 * se + 1e-12, (est_mean, exact_mean, se)
    se_std = math.sqrt(max(mu4 - exact_std ** 4, 0.0) / N_BOOTSTRAP) / (2 * exact_std) if exact_std else 0.0
    assert abs(est_std - exact_std) <= 4 * se_std + 1e-12, (est_std, exact_std, se_std)


def test_subset_sizes_are_powers_of_two_then_n():
    assert subset_sizes(1) == [] and subset_sizes(2) == [2] and subset_sizes(4) == [2, 4]
    assert subset_sizes(5) == [2, 4, 5] and subset_sizes(8) == [2, 4, 8] and subset_sizes(16) == [2, 4, 8, 16]


def test_mean_and_std_exact_and_averaged_over_prompts():
    # prompt a: [1, 0, 0, 1] -> mean 0.5, std 0.5; prompt b: [0, 0, 0, 0] -> 0, 0
    # prompt c (other source): [0.2, 0.4] -> mean 0.3, population std 0.1
    ds = ["x"] * 8 + ["y"] * 2
    uids = ["a"] * 4 + ["b"] * 4 + ["c"] * 2
    scores = [1, 0, 0, 1, 0, 0, 0, 0, 0.2, 0.4]
    m = process_validation_metrics(ds, uids, {"reward": scores})
    assert m["x"]["reward"]["mean@4"] == pytest.approx(0.25, abs=1e-12)
    assert m["x"]["reward"]["std@4"] == pytest.approx(0.25, abs=1e-12)
    assert m["y"]["reward"]["mean@2"] == pytest.approx(0.3, abs=1e-12)
    assert m["y"]["reward"]["std@2"] == pytest.approx(0.1, abs=1e-12)
    # prompt b is all 0: its best and worst are exactly 0, so source x's best@4 is half of prompt a's
    a = prompt_metrics([1, 0, 0, 1])
    assert m["x"]["reward"]["best@4/mean"] == pytest.approx(a["best@4/mean"] / 2, abs=1e-12)
    assert m["x"]["reward"]["worst@2/mean"] == pytest.approx(a["worst@2/mean"] / 2, abs=1e-12)


@pytest.mark.parametrize("values", [[1, 0, 0, 1], [0.1, 0.9, 0.4, 0.7, 0.2], [0, 0, 0, 1, 0, 0, 0, 0]])
def test_best_and_worst_match_brute_force(values):
    m = prompt_metrics(values)
    ks = subset_sizes(len(values))
    assert {f"{w}@{k}/{s}" for w in ("best", "worst") for k in ks for s in ("mean", "std")} | \
        {f"mean@{len(values)}", f"std@{len(values)}"} == set(m)
    for k in ks:
        if len(values) ** k > 5e5:  # N=8, k=8: use the closed form P(max <= x_(j)) = (j/N)^k instead
            xs, n = sorted(values), len(values)
            best = _moments([(j / n) ** k - ((j - 1) / n) ** k for j in range(1, n + 1)], xs)
            worst = _moments([((n - j + 1) / n) ** k - ((n - j) / n) ** k for j in range(1, n + 1)], xs)
        else:
            best, worst = _exact(values, k, max), _exact(values, k, min)
        _close(m[f"best@{k}/mean"], m[f"best@{k}/std"], *best)
        if worst[1] > 0:
            _close(m[f"worst@{k}/mean"], m[f"worst@{k}/std"], *worst)
        else:
            assert m[f"worst@{k}/mean"] == pytest.approx(worst[0], abs=1e-3)
    # binary scores with p = 1/2: E[best@2] = 1 - (1/2)^2 = 0.75, E[worst@4] = (1/2)^4 (hand check of the above)
    if values == [1, 0, 0, 1]:
        assert abs(m["best@2/mean"] - 0.75) < 0.06 and abs(m["worst@4/mean"] - 0.0625) < 0.04


def test_majority_value_ties_go_to_first_seen():
    assert majority_value([1.0, 0.0, 0.0], ["7", "3", "3"]) == 0.0
    assert majority_value([1.0, 0.0], ["7", "3"]) == 1.0  # tie: first pred seen wins
    assert majority_value([0.0, 1.0], ["3", "7"]) == 0.0
    assert majority_value([0.5, 0.25, 1.0], ["a", "a", "b"]) == 0.5  # value of the FIRST answer with the majority pred


def test_vectorised_majority_equals_the_per_row_rule():
    rng = np.random.default_rng(0)
    vals = rng.random(9)
    preds = [str(p) for p in rng.integers(0, 4, 9)]
    idx = rng.integers(0, 9, size=(500, 6))
    want = [majority_value(vals[row], [preds[j] for j in row]) for row in idx]
    assert majority_values(vals, preds, idx).tolist() == want


def test_maj_matches_brute_force_and_only_with_pred():
    vals = [1.0, 0.0, 0.0, 1.0, 0.0]
    preds = ["42", "41", "40", "42", "41"]
    m = prompt_metrics(vals, preds)
    for k in subset_sizes(len(vals)):
        draws = list(itertools.product(range(len(vals)), repeat=k))
        r = np.array([majority_value([vals[j] for j in d], [preds[j] for j in d]) for d in draws])
        _close(m[f"maj@{k}/mean"], m[f"maj@{k}/std"], *_moments(np.full(len(r), 1 / len(r)), r))
    assert not any(k.startswith("maj") for k in prompt_metrics(vals))


def test_verl_key_names_and_core_section():
    ds, uids = ["gsm8k"] * 4, ["u", "u", "v", "v"]
    flat = validation_metric_dict(process_validation_metrics(ds, uids, {"reward": [1.0, 0.0, 1.0, 1.0]}))
    assert set(flat) == {
        "val-core/gsm8k/reward/mean@2", "val-aux/gsm8k/reward/std@2",
        "val-core/gsm8k/reward/best@2/mean", "val-core/gsm8k/reward/best@2/std",
        "val-aux/gsm8k/reward/worst@2/mean", "val-aux/gsm8k/reward/worst@2/std",
    }
    assert flat["val-core/gsm8k/reward/mean@2"] == 0.75
    # acc present: acc is the core variable, reward goes to val-aux; pred strings yield maj@k but no metrics of their own
    infos = {"reward": [1.0, 0.0, 0.5, 1.0], "acc": [True, False, False, True], "pred": ["1", "2", "2", "1"]}
    flat = validation_metric_dict(process_validation_metrics(ds, uids, infos))
    assert "val-core/gsm8k/acc/mean@2" in flat and "val-core/gsm8k/acc/maj@2/mean" in flat
    assert "val-aux/gsm8k/reward/mean@2" in flat and "val-aux/gsm8k/reward/maj@2/std" in flat
    assert not any("/pred/" in k for k in flat)
    assert all(k.startswith(("val-core/gsm8k/acc/mean@2", "val-core/gsm8k/acc/best@2", "val-core/gsm8k/acc/maj@2"))
               for k in flat if k.startswith("val-core"))


def test_n1_keeps_the_greedy_name_and_core_is_the_largest_n():
    flat = validation_metric_dict(process_validation_metrics([None, None], [0, 1], {"reward": [1.0, 0.0]}))
    assert flat == {"val-core/unknown/reward/mean@1": 0.5}
    # N = 4: only the @4 names are core, best@2 is aux
    flat = validation_metric_dict(process_validation_metrics(["d"] * 4, [0] * 4, {"reward": [1.0, 0.0, 0.0, 1.0]}))
    assert "val-core/d/reward/best@4/mean" in flat and "val-aux/d/reward/best@2/mean" in flat
    assert "val-core/d/reward/mean@4" in flat and "val-aux/d/reward/worst@4/mean" in flat


def test_seeded_reproducible_and_global_numpy_state_untouched():
    vals = [0.1, 0.9, 0.4, 0.7]
    np.random.seed(123)
    before = np.random.rand()
    np.random.seed(123)
    a = prompt_metrics(vals)
    assert np.random.rand() == before  # our draws did not consume the global generator
    assert prompt_metrics(vals) == a
    assert prompt_metrics(vals, seed=7)["best@2/mean"] != a["best@2/mean"]


def test_draws_equal_verls_legacy_global_seeding():
    # verl: np.random.seed(seed); np.random.choice(n, size=(B, k), replace=True). Same rows here.
    np.random.seed(42)
    idx = np.random.choice(4, size=(N_BOOTSTRAP, 2), replace=True)
    x = np.array([0.1, 0.9, 0.4, 0.7])
    m = prompt_metrics(x.tolist())
    assert m["best@2/mean"] == float(x[idx].max(axis=1).mean())


def test_length_mismatch_names_the_counts():
    with pytest.raises(ValueError, match="3 uids but 2 data sources"):
        process_validation_metrics(["a", "a"], [0, 0, 1], {"reward": [1.0, 0.0, 1.0]})


def test_dict_scorer_extra_keys_drive_acc_core_and_maj():
    """A verl-style dict scorer through the real RewardManager: its numeric keys become variables,
    ``acc`` the core one, and ``pred`` (None included: no answer extracted) the vote of maj@k."""
    from mrl.rewards import RewardManager

    # prompt u: 3 of 4 answers agree on the wrong "8"; prompt v: the right "5" twice, "6" once, none once
    texts = [" 8", " 7", " 8", " 8", " 5", " 6", " 5", " "]
    truths = ["7"] * 4 + ["5"] * 4
    r = RewardManager("tests.rewards._scorers:dict_score")(texts, truths)
    assert r.extra["pred"] == ["8", "7", "8", "8", "5", "6", "5", None]
    uids, ds = ["u"] * 4 + ["v"] * 4, ["math"] * 8
    nested = process_validation_metrics(ds, uids, {"reward": r.scores.tolist(), **r.extra})
    flat = validation_metric_dict(nested)
    core = {k for k in flat if k.startswith("val-core/")}
    assert core == {f"val-core/math/acc/{n}" for n in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std")}
    for var in ("reward", "score", "length"):  # verl keeps "score" in reward_extra_info too
        assert f"val-aux/math/{var}/mean@4" in flat and f"val-aux/math/{var}/maj@4/mean" in flat
    assert not any("/pred/" in k for k in flat)
    assert flat["val-core/math/acc/mean@4"] == pytest.approx((0.25 + 0.5) / 2)
    assert flat["val-aux/math/score/mean@4"] == flat["val-aux/math/reward/mean@4"] == pytest.approx((-0.5 + 0.0) / 2)

    def maj(draw):  # independent of the module: Counter order = first seen, most_common keeps it on ties
        from collections import Counter

        top = Counter(p for p, _ in draw).most_common(1)[0][0]
        return next(a for p, a in draw if p == top)

    for k in (2, 4):
        exact = [_exact(list(zip(r.extra["pred"][i:i + 4], r.extra["acc"][i:i + 4])), k, maj) for i in (0, 4)]
        per_prompt = [prompt_metrics(r.extra["acc"][i:i + 4], r.extra["pred"][i:i + 4]) for i in (0, 4)]
        for (mu, sd, _), m in zip(exact, per_prompt):
            # acc is 0/1, so the draws' std is sqrt(p(1-p)) of their mean exactly (and _close's std
            # bound degenerates at p = 1/2); the mean is within 4 standard errors of the exact one
            est = m[f"maj@{k}/mean"]
            assert abs(est - mu) <= 4 * sd / math.sqrt(N_BOOTSTRAP), (k, est, mu)
            assert m[f"maj@{k}/std"] == pytest.approx(math.sqrt(est * (1 - est)), abs=1e-9)
        assert nested["math"]["acc"][f"maj@{k}/mean"] == pytest.approx(np.mean([m[f"maj@{k}/mean"] for m in per_prompt]))
    # the wrong majority of prompt u pulls maj@4 below mean@4's 0.25 of that prompt
    assert prompt_metrics(r.extra["acc"][:4], r.extra["pred"][:4])["maj@4/mean"] < 0.25
