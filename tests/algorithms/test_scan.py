"""Blockwise GEMM scans (mrl/algorithms/scan.py) against a step-by-step reference loop over time.

Covers the prefix-mask fast path and the compaction path for masks with holes (and checks which one
ran), every block geometry (T a multiple of K, not, T < K, T = 1, one row per chunk), float64 to
1e-12 and float32 to 1e-5 relative, and the moments used for whitening; then that the worker
threads and the broadcast estimators change nothing in the results.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mrl.algorithms import get_adv_estimator, masked_whiten, scan


def _loop_gae(r, v, m, gamma, lam):
    """The recursion written out: backwards over t, masked tokens carry A and V' unchanged."""
    r, v, m = r.double(), v.double(), m.double()
    adv = torch.zeros_like(r)
    last = torch.zeros(r.shape[0], dtype=torch.float64)
    next_v = torch.zeros_like(last)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        last = torch.where(m[:, t] > 0, delta + gamma * lam * last, last)
        next_v = torch.where(m[:, t] > 0, v[:, t], next_v)
        adv[:, t] = last
    return adv * m, (adv + v) * m


def _loop_discounted(x, m, gamma):
    x, m = x.double(), m.double()
    out = torch.zeros_like(x)
    run = torch.zeros(x.shape[0], dtype=torch.float64)
    for t in reversed(range(x.shape[1])):
        run = torch.where(m[:, t] > 0, x[:, t] + gamma * run, run)
        out[:, t] = run
    return out * m


def _data(b, t, dtype, holes, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(b, t, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, t, generator=g, dtype=torch.float64).to(dtype)
    lens = torch.randint(0, t + 1, (b,), generator=g)
    lens[0], lens[-1] = 0, t  # an empty and a full response
    m = (torch.arange(t)[None] < lens[:, None]).to(dtype)
    if holes:
        m = m * (torch.rand(b, t, generator=g) > 0.3).to(dtype)  # observation tokens inside responses
    return r, v, m


def _count_compactions(monkeypatch):
    calls = []
    orig = scan._Chunks.compact

    def spy(self, *a):
        calls.append(1)
        return orig(self, *a)

    monkeypatch.setattr(scan._Chunks, "compact", spy)
    return calls


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("t_len,k,rows", [(37, 8, 5), (32, 8, 64), (5, 16, 3), (1, 4, 2), (12, 1, 3)])
def test_gae_and_discounted_scans_match_loop_float64(monkeypatch, holes, t_len, k, rows):
    monkeypatch.setattr(scan, "TIME_BLOCK", k)
    monkeypatch.setattr(scan, "ELEM_ELEMENTS", rows * t_len)
    calls = _count_compactions(monkeypatch)
    r, v, m = _data(13, t_len, torch.float64, holes)
    has_holes = not torch.equal(m, (torch.arange(t_len)[None] < m.sum(-1, keepdim=True)).double())
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)]:
        adv, ret, mom = scan.gae_scan(r, v, m, gamma, lam)
        want_adv, want_ret = _loop_gae(r, v, m, gamma, lam)
        torch.testing.assert_close(adv, want_adv, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret, want_ret, rtol=1e-12, atol=1e-12)
        assert mom.n == m.sum().item()
        assert mom.s1 == pytest.approx(want_adv.sum().item(), rel=1e-12, abs=1e-12)
        assert mom.s2 == pytest.approx((want_adv ** 2).sum().item(), rel=1e-12, abs=1e-12)
        g, gmom = scan.discounted_scan(r, m, gamma)
        want_g = _loop_discounted(r, m, gamma)
        torch.testing.assert_close(g, want_g, rtol=1e-12, atol=1e-12)
        assert gmom.s2 == pytest.approx((want_g ** 2).sum().item(), rel=1e-12, abs=1e-12)
    assert bool(calls) == has_holes  # prefix chunks never take the compaction path


@pytest.mark.parametrize("holes", [False, True])
def test_float32_within_1e5_relative_of_float64_loop(holes):
    r, v, m = _data(32, 500, torch.float32, holes, seed=3)
    adv, ret, _ = scan.gae_scan(r, v, m, 0.999, 0.99)
    want_adv, want_ret = _loop_gae(r, v, m, 0.999, 0.99)
    for got, want in ((adv, want_adv), (ret, want_ret)):
        err = (got.double() - want).abs() / want.abs().clamp(min=1.0)  # relative, floor 1 for values near 0
        assert err.max().item() < 1e-5
    g, _ = scan.discounted_scan(r, m, 1.0)
    want_g = _loop_discounted(r, m, 1.0)
    assert ((g.double() - want_g).abs() / want_g.abs().clamp(min=1.0)).max().item() < 1e-5


def test_estimators_whiten_with_scan_moments_and_accept_bool_masks():
    r, v, m = _data(9, 23, torch.float64, holes=True, seed=7)
    adv, ret = get_adv_estimator("gae")(r, m.bool(), values=v, gamma=0.97, lam=0.9)
    raw, want_ret = _loop_gae(r, v, m, 0.97, 0.9)
    torch.testing.assert_close(ret, want_ret, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, masked_whiten(raw, m) * m, rtol=1e-10, atol=1e-12)
    adv2, g = get_adv_estimator("reinforce_plus_plus")(r, m.bool(), gamma=0.9)
    want_g = _loop_discounted(r, m, 0.9)
    torch.testing.assert_close(g, want_g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv2, masked_whiten(want_g, m) * m, rtol=1e-10, atol=1e-12)


def test_empty_batch_and_empty_time():
    for b, t in ((0, 5), (3, 0)):
        z = torch.zeros(b, t)
        adv, ret, mom = scan.gae_scan(z, z, z, 1.0, 1.0)
        assert adv.shape == ret.shape == (b, t) and mom.n == 0
        assert scan.discounted_scan(z, z, 0.9)[0].shape == (b, t)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_outputs_exactly_zero_outside_prefix_masks_float32(gamma, lam):
    """Whitening reads the scan outputs as 0 outside the mask; the c = 1 cumsum path must not leave
    rounding residue (S - cumsum_t) after the last valid token."""
    r, v, m = _data(40, 1000, torch.float32, holes=False, seed=11)
    r = r * 10
    adv, ret, _ = scan.gae_scan(r, v, m, gamma, lam)
    g, _ = scan.discounted_scan(r, m, gamma)
    for x in (adv, ret, g):
        assert torch.count_nonzero(x * (1 - m)).item() == 0


def _all_outputs(r, v, m):
    adv, ret, mom = scan.gae_scan(r, v, m, 0.99, 0.95)
    g1, mom1 = scan.discounted_scan(r, m, 1.0)
    g2, mom2 = scan.discounted_scan(r, m, 0.9)
    white = scan.whiten_with_moments(adv, m, mom)
    return (adv, ret, g1, g2, white), (mom, mom1, mom2)


@pytest.mark.parametrize("holes", [False, True])
def test_results_do_not_depend_on_the_thread_count(monkeypatch, holes):
    """Chunks go to worker threads when torch has more than one thread; each chunk is computed as
    with one thread and the per-chunk moments are added in chunk order, so the outputs are
    bit-identical for 1, 2 and 3 threads, and the caller's thread count is left alone."""
    monkeypatch.setattr(scan, "ELEM_ELEMENTS", 7 * 50)  # 7 rows per chunk: 15 chunks, a short last one
    r, v, m = _data(101, 50, torch.float32, holes, seed=4)
    ran_on = []
    orig = scan._Chunks.scan

    def spy(self, n):
        ran_on.append((threading.current_thread().name, torch.get_num_threads()))
        return orig(self, n)

    monkeypatch.setattr(scan._Chunks, "scan", spy)
    n0 = torch.get_num_threads()
    got = {}
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            ran_on.clear()
            got[nt] = _all_outputs(r, v, m)
            assert torch.get_num_threads() == nt
            on_pool = [name.startswith("mrl-scan") for name, _ in ran_on]
            # nt > 1: every chunk runs on the pool's threads (which of them takes how many is up to
            # the scheduler: a loaded host may give one thread all of them, so that is not asserted)
            assert len(ran_on) == 3 * 15 and (not any(on_pool) if nt == 1 else all(on_pool))
            assert {k for _, k in ran_on} == {1}  # one intra-op thread inside every chunk
    finally:
        torch.set_num_threads(n0)
    want_adv, want_ret = _loop_gae(r, v, m, 0.99, 0.95)
    for got_t, want in ((got[1][0][0], want_adv), (got[1][0][1], want_ret)):
        assert ((got_t.double() - want).abs() / want.abs().clamp(min=1.0)).max().item() < 1e-5
    for nt in (2, 3):
        for a, b in zip(got[1][0], got[nt][0]):
            assert torch.equal(a, b)
        assert got[1][1] == got[nt][1]


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_worker_threads_follow_the_callers_grad_mode(monkeypatch, mode):
    """Outputs allocated under inference_mode are inference tensors: the workers, which write them,
    must run in inference mode too (grad modes are thread-local)."""
    monkeypatch.setattr(scan, "ELEM_ELEMENTS", 5 * 30)
    r, v, m = _data(23, 30, torch.float64, holes=True, seed=6)
    want_adv, want_ret = _loop_gae(r, v, m, 0.97, 0.9)
    want_g = _loop_discounted(r, m, 1.0)
    ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    n0 = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with ctx():
            adv, ret = get_adv_estimator("gae")(r, m, values=v, gamma=0.97, lam=0.9)
            adv2, g = get_adv_estimator("reinforce_plus_plus")(r, m, gamma=1.0)
    finally:
        torch.set_num_threads(n0)
    torch.testing.assert_close(ret, want_ret, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, masked_whiten(want_adv, m) * m, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, want_g, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv2, masked_whiten(want_g, m) * m, rtol=1e-10, atol=1e-12)
    assert ret.is_inference() == (mode == "inference_mode")


def test_worker_pool_is_rebuilt_after_fork(monkeypatch):
    """Threads do not survive fork: a pool recorded under another pid is replaced, not used."""
    dead = ThreadPoolExecutor(1)
    dead.shutdown()
    monkeypatch.setattr(scan, "_POOL", (os.getpid() + 1, 64, dead))
    r, v, m = _data(20, 30, torch.float64, holes=True, seed=2)
    monkeypatch.setattr(scan, "ELEM_ELEMENTS", 4 * 30)
    n0 = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        adv, ret, _ = scan.gae_scan(r, v, m, 0.9, 0.8)
    finally:
        torch.set_num_threads(n0)
    assert scan._POOL[0] == os.getpid() and scan._POOL[2] is not dead
    want_adv, want_ret = _loop_gae(r, v, m, 0.9, 0.8)
    torch.testing.assert_close(adv, want_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, want_ret, rtol=1e-12, atol=1e-12)


def test_broadcast_estimators_promote_dtypes_and_accept_bool_masks():
    r, _, m = _data(12, 9, torch.float32, holes=False, seed=5)
    uid = [i // 3 for i in range(12)]
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        a32, _ = get_adv_estimator(name)(r, m, index=uid)
        a64, _ = get_adv_estimator(name)(r, m.double(), index=uid)
        ab, _ = get_adv_estimator(name)(r, m.bool(), index=uid)
        assert a32.dtype == ab.dtype == torch.float32 and a64.dtype == torch.float64
        torch.testing.assert_close(ab, a32, rtol=0, atol=0)
        torch.testing.assert_close(a64.float(), a32, rtol=1e-6, atol=1e-6)
        assert torch.count_nonzero(a32 * (1 - m)).item() == 0
