"""Time the advantage estimators on CPU at 100k samples x 1k response tokens.

    .venv/bin/python benchmarks/adv_estimators.py [--samples 100000] [--tokens 1000] [--n 4] [--repeats 3]

For every estimator: the best-of-``repeats`` wall seconds with torch's default thread count (or
``--threads``) and the best CPU seconds (``time.process_time()``, all threads of this process)
with ``torch.set_num_threads(1)``. Side by side, two naive alternatives with the ratios: for GRPO a
per-group Python loop (the shape of verl's dict-of-lists code), for GAE the step-by-step Python
loop over the T time steps (batch-vectorised, on transposed blocks of samples: mrl's first kernel;
verl's loop over t is the same recursion). Inputs: float32 outcome rewards on the last valid token,
prefix masks of random length, string uids (``n`` samples per prompt, interleaved as after
``repeat(interleave=True)``).
"""
from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import numpy as np
import torch

from mrl.algorithms import get_adv_estimator


def naive_grpo(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray,
               epsilon: float = 1e-6) -> torch.Tensor:
    """Per-sample / per-group Python loops (the alternative being compared against)."""
    scores = token_level_rewards.sum(dim=-1)
    groups: dict = defaultdict(list)
    for i in range(scores.shape[0]):
        groups[index[i]].append(i)
    out = torch.empty_like(scores)
    for members in groups.values():
        s = scores[members]
        if len(members) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = s.mean(), s.std()
        for i in members:
            out[i] = (scores[i] - mean) / (std + epsilon)
    return out.unsqueeze(-1) * response_mask


def loop_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
             rows: int = 16384) -> torch.Tensor:
    """Returns ``(A + V) * m`` ``[B, T]`` by the recursion step by step: a Python loop over t, each step
    one vector op per quantity over a block of ``rows`` samples stored as ``[T, rows]``."""
    b, t_len = rewards.shape
    ret = torch.empty_like(rewards)
    for s in range(0, b, rows):
        r, v, m = (x[s:s + rows].t().contiguous() for x in (rewards, values, mask))
        a = torch.empty_like(r)
        next_v = torch.zeros(r.shape[1])
        last = torch.zeros_like(next_v)
        for t in range(t_len - 1, -1, -1):
            cand = (r[t] + gamma * next_v - v[t]).add_(last, alpha=gamma * lam)
            a[t] = torch.lerp(last, cand, m[t])  # masked token: carry A over
            last = a[t]
            next_v = torch.lerp(next_v, v[t], m[t])
        ret[s:s + rows] = ((a + v) * m).t()
    return ret


def best_of(fn, repeats: int, threads: int) -> tuple[float, float]:
    """Best wall seconds and best CPU seconds (all threads of this process) over ``repeats`` runs
    with ``torch.set_num_threads(threads)``.

    CPU time is reported too because shared CI hosts are oversubscribed: wall time then measures the
    neighbours as much as the code.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    walls, cpus = [], []
    try:
        for _ in range(repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
    finally:
        torch.set_num_threads(before)
    return min(walls), min(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=1_000)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--naive-repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads for the wall-time column (default: torch's default here)")
    args = ap.parse_args()
    nt = args.threads
    B, T = args.samples, args.tokens
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).float()
    values = torch.randn(B, T, generator=g) * mask
    prompt_uids = np.array([f"{i:08x}-uid" for i in range((B + args.n - 1) // args.n)], dtype=object)
    index = np.repeat(prompt_uids, args.n)[:B]
    baselines = torch.rand(B, generator=g)

    print(f"torch {torch.__version__}, default threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
          f"load avg {os.getloadavg()[0]:.1f}; B={B} samples x T={T} tokens, group size {args.n}")
    calls = {
        "grpo": lambda: get_adv_estimator("grpo")(rewards, mask, index=index),
        "rloo": lambda: get_adv_estimator("rloo")(rewards, mask, index=index),
        "reinforce_plus_plus": lambda: get_adv_estimator("reinforce_plus_plus")(rewards, mask, gamma=1.0),
        "reinforce_plus_plus(gamma=0.99)": lambda: get_adv_estimator("reinforce_plus_plus")(rewards, mask, gamma=0.99),
        "reinforce_plus_plus_baseline": lambda: get_adv_estimator("reinforce_plus_plus_baseline")(
            rewards, mask, index=index),
        "remax": lambda: get_adv_estimator("remax")(rewards, mask, reward_baselines=baselines),
        "gae": lambda: get_adv_estimator("gae")(rewards, mask, values=values, gamma=1.0, lam=0.95),
        "gae(gamma=1, lam=1)": lambda: get_adv_estimator("gae")(rewards, mask, values=values, gamma=1.0, lam=1.0),
    }
    results, single = {}, {}
    print(f"{'estimator':34s} {f'wall s ({nt} thr)':>16s} {f'cpu s ({nt} thr)':>15s} {'wall s (1 thr)':>15s} "
          f"{'cpu s (1 thr)':>14s}")
    for name, fn in calls.items():
        results[name] = best_of(fn, args.repeats, nt)
        single[name] = best_of(fn, args.repeats, 1)
        print(f"{name:34s} {results[name][0]:16.3f} {results[name][1]:15.3f} {single[name][0]:15.3f} "
              f"{single[name][1]:14.3f}", flush=True)
    ours = get_adv_estimator("grpo")(rewards, mask, index=index)[0]
    ref = naive_grpo(rewards, mask, index)
    same = torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)
    w, _ = best_of(lambda: naive_grpo(rewards, mask, index), args.naive_repeats, nt)
    _, c = best_of(lambda: naive_grpo(rewards, mask, index), args.naive_repeats, 1)
    print(f"{'grpo naive per-group loop':34s} {w:16.3f} {'':15s} {'':15s} {c:14.3f}   naive/ours: wall "
          f"{w / results['grpo'][0]:.1f}x, cpu {c / single['grpo'][1]:.1f}x   (same result: {same})")
    gae_ret = get_adv_estimator("gae")(rewards, mask, values=values, gamma=1.0, lam=0.95)[1]
    same = torch.allclose(gae_ret, loop_gae(rewards, values, mask, 1.0, 0.95), rtol=1e-5, atol=1e-5)
    w, _ = best_of(lambda: loop_gae(rewards, values, mask, 1.0, 0.95), args.naive_repeats, nt)
    _, c = best_of(lambda: loop_gae(rewards, values, mask, 1.0, 0.95), args.naive_repeats, 1)
    print(f"{'gae step-by-step loop over t':34s} {w:16.3f} {'':15s} {'':15s} {c:14.3f}   loop/ours: wall "
          f"{w / results['gae'][0]:.1f}x, cpu {c / single['gae'][1]:.1f}x   (same returns: {same})")
    print(f"load avg at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
