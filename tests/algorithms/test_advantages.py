"""Advantage estimators: GRPO worked numbers, group edge cases, RLOO/RF++/ReMax, GAE vs a reference loop."""
import numpy as np
import pytest
import torch

from mrl.algorithms import get_adv_estimator, masked_whiten

SQ3 = 3 ** 0.5


def _outcome(scores, T=4, lengths=None):
    """Rewards on the last valid token of each response ([B, T]) and the prefix mask."""
    B = len(scores)
    lengths = lengths or [T] * B
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    r = torch.zeros(B, T)
    r[torch.arange(B), torch.tensor(lengths) - 1] = torch.tensor(scores, dtype=torch.float32)
    return r, mask


def test_grpo_seed_004_example_unbiased_std():
    r, m = _outcome([1, 0, 1, 1, 0, 0], lengths=[4, 2, 3, 4, 1, 4])
    uid = np.array(["uid1"] * 3 + ["uid2"] * 3, dtype=object)
    adv, ret = get_adv_estimator("grpo")(r, m, index=uid)
    want = torch.tensor([1 / SQ3, -2 / SQ3, 1 / SQ3, 2 / SQ3, -1 / SQ3, -1 / SQ3])  # ±0.5774, ∓1.1547
    torch.testing.assert_close(adv[:, 0], want, rtol=1e-5, atol=1e-6)
    assert adv[1, 0].item() == pytest.approx(-1.1547, abs=1e-4) and adv[0, 0].item() == pytest.approx(0.5774, abs=1e-4)
    torch.testing.assert_close(adv, want[:, None] * m, rtol=1e-5, atol=1e-6)  # broadcast, 0 outside mask
    assert ret is adv or torch.equal(ret, adv)


def test_grpo_dr_grpo_singletons_equal_rewards_and_interleaved_uids():
    r, m = _outcome([1, 0, 5, 2, 2, 0.5])
    uid = ["a", "b", "a", "c", "c", "a"]  # interleaved; 'b' is a singleton; 'c' has equal rewards
    adv, _ = get_adv_estimator("grpo")(r, m, index=uid, norm_adv_by_std_in_grpo=False)
    mean_a = (1 + 5 + 0.5) / 3
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 - mean_a, 0.0, 5 - mean_a, 0.0, 0.0, 0.5 - mean_a]))
    adv_n, _ = get_adv_estimator("grpo")(r, m, index=uid)
    assert torch.isfinite(adv_n).all()
    assert adv_n[3, 0].item() == 0.0 and adv_n[4, 0].item() == 0.0  # equal rewards: 0, not NaN
    assert adv_n[1, 0].item() == pytest.approx(0.0 / (1 + 1e-6))  # singleton: mean 0, std 1 -> r
    r1, m1 = _outcome([3.0])
    assert get_adv_estimator("grpo")(r1, m1, index=["x"])[0][0, 0].item() == pytest.approx(3.0 / (1 + 1e-6))
    # integer tensor uids give the same result as strings
    adv_t, _ = get_adv_estimator("grpo")(r, m, index=torch.tensor([0, 1, 0, 2, 2, 0]))
    torch.testing.assert_close(adv_t, adv_n)


def test_grpo_missing_index_names_it():
    r, m = _outcome([1, 0])
    with pytest.raises(ValueError, match="needs `index`"):
        get_adv_estimator("grpo")(r, m)


def test_grpo_matches_a_per_group_loop_on_random_data():
    g = torch.Generator().manual_seed(0)
    B, T = 64, 5
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = torch.ones(B, T, dtype=torch.float64)
    uid = torch.randint(0, 12, (B,), generator=g)
    adv, _ = get_adv_estimator("grpo")(r, m, index=uid)
    s = r.sum(-1)
    for u in uid.unique():
        sel = uid == u
        if sel.sum() == 1:
            want = s[sel] / (1 + 1e-6)
        else:
            want = (s[sel] - s[sel].mean()) / (s[sel].std() + 1e-6)
        torch.testing.assert_close(adv[sel, 0], want, rtol=1e-10, atol=1e-12)


def test_rloo_leave_one_out():
    r, m = _outcome([1, 0, 1, 4])
    adv, _ = get_adv_estimator("rloo")(r, m, index=[0, 0, 0, 1])
    torch.testing.assert_close(adv[:, 0], torch.tensor([1 - 0.5, 0 - 1.0, 1 - 0.5, 4.0]))


def test_reinforce_plus_plus_baseline_and_plain():
    r, m = _outcome([1, 0, 1, 0, 0, 0], lengths=[4, 2, 3, 4, 1, 4])
    uid = [0, 0, 0, 1, 1, 1]
    adv, _ = get_adv_estimator("reinforce_plus_plus_baseline")(r, m, index=uid)
    base = torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.0, 0.0, 0.0])[:, None] * m
    torch.testing.assert_close(adv, masked_whiten(base, m) * m)
    assert adv[m.bool()].mean().abs().item() < 1e-6
    adv2, ret = get_adv_estimator("reinforce_plus_plus")(r, m, gamma=0.5)
    want_ret = torch.zeros_like(r)
    for i, L in enumerate([4, 2, 3, 4, 1, 4]):
        for t in range(L):
            want_ret[i, t] = r[i, L - 1] * 0.5 ** (L - 1 - t)
    torch.testing.assert_close(ret, want_ret)
    torch.testing.assert_close(adv2, masked_whiten(want_ret, m) * m)
    _, ret1 = get_adv_estimator("reinforce_plus_plus")(r, m, gamma=1.0)  # cumsum fast path
    torch.testing.assert_close(ret1, r.sum(-1, keepdim=True) * m)


def test_remax_subtracts_greedy_baseline():
    r, m = _outcome([1.0, 0.0], lengths=[3, 2])
    adv, ret = get_adv_estimator("remax")(r, m, reward_baselines=torch.tensor([0.25, 0.5]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1, 1, 0], [0, 0, 0, 0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.75, 0], [-0.5, -0.5, 0, 0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        get_adv_estimator("remax")(r, m)


def _gae_reference(r, v, m, gamma, lam):
    """Per-sample loop over the valid tokens only (observation/padding tokens are skipped)."""
    adv = torch.zeros_like(r)
    for i in range(r.shape[0]):
        valid = [t for t in range(r.shape[1]) if m[i, t] > 0]
        last = 0.0
        for j in reversed(range(len(valid))):
            t = valid[j]
            v_next = v[i, valid[j + 1]] if j + 1 < len(valid) else 0.0
            delta = r[i, t] + gamma * v_next - v[i, t]
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_loop_with_holes(gamma, lam):
    g = torch.Generator().manual_seed(1)
    B, T = 6, 9
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)  # holes = multi-turn observation tokens
    m[0] = 0  # an empty response
    m[1] = 1
    adv, ret = get_adv_estimator("gae")(r, m, values=v, gamma=gamma, lam=lam)
    raw = _gae_reference(r, v, m, gamma, lam)
    torch.testing.assert_close(ret, (raw + v) * m, rtol=1e-10, atol=1e-12)  # returns = advantages + values
    torch.testing.assert_close(adv, masked_whiten(raw, m) * m, rtol=1e-10, atol=1e-12)
    assert adv[m.bool()].mean().abs().item() < 1e-10 and abs(adv[m.bool()].std().item() - 1) < 1e-6


def test_gae_seed_002_example():
    r = torch.tensor([[-0.003, -0.002, -0.003, -0.002, -0.003, 0.999]], dtype=torch.float64)
    v = torch.tensor([[0.82, 0.85, 0.88, 0.90, 0.92, 0.95]], dtype=torch.float64)
    _, ret = get_adv_estimator("gae")(r, torch.ones_like(r), values=v, gamma=1.0, lam=0.95)
    raw = ret - v
    assert raw[0, 5].item() == pytest.approx(0.049, abs=1e-12)  # delta[5] = 0.999 - 0.95
    assert raw[0, 4].item() == pytest.approx(0.027 + 0.95 * 0.049, abs=1e-12)  # 0.074 in the seed
    with pytest.raises(ValueError, match="needs `values`"):
        get_adv_estimator("gae")(r, torch.ones_like(r))


@pytest.mark.parametrize("block_rows", [1, 4, 10_000])
def test_blocked_kernels_do_not_depend_on_block_size(monkeypatch, block_rows):
    from mrl.algorithms import scan

    monkeypatch.setattr(scan, "BLOCK_ROWS", block_rows)
    monkeypatch.setattr(scan, "ELEM_ELEMENTS", block_rows * 7)  # elementwise passes: block_rows rows of T=7
    g = torch.Generator().manual_seed(5)
    B, T = 11, 7
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    m = (torch.rand(B, T, generator=g) > 0.25).to(torch.float64)
    adv, ret = get_adv_estimator("gae")(r, m, values=v, gamma=0.97, lam=0.9)
    raw = _gae_reference(r, v, m, 0.97, 0.9)
    torch.testing.assert_close(ret, (raw + v) * m, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adv, masked_whiten(raw, m) * m, rtol=1e-10, atol=1e-12)
    adv2, ret2 = get_adv_estimator("reinforce_plus_plus")(r, m, gamma=0.9)
    want = torch.zeros_like(r)
    for i in range(B):
        run = 0.0
        for t in reversed(range(T)):
            if m[i, t] > 0:
                run = r[i, t] + 0.9 * run
                want[i, t] = run
    torch.testing.assert_close(ret2, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(adv2, masked_whiten(want, m) * m, rtol=1e-10, atol=1e-12)
    x = torch.randn(B, T, generator=g, dtype=torch.float64) + 3.0
    torch.testing.assert_close(scan.masked_whiten_(x.clone(), m), masked_whiten(x, m) * m, rtol=1e-10, atol=1e-12)
    _, ret3 = get_adv_estimator("remax")(r, m, reward_baselines=torch.zeros(B, dtype=torch.float64))
    torch.testing.assert_close(ret3, torch.flip(torch.cumsum(torch.flip(r * m, [-1]), -1), [-1]) * m)
