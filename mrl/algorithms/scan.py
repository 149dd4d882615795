"""Memory-lean kernels behind the estimators: blocked reverse scans over time and in-place whitening.

At 100k samples x 1k tokens every ``[B, T]`` float32 temporary is 400 MB, and on CPU a fresh one
costs page faults on top of the arithmetic. These kernels therefore work on blocks of
``BLOCK_ROWS`` samples, transposed to ``[T, rows]`` in reused buffers (each time step then reads one
contiguous row), and write each result once into its ``[B, T]`` output.
"""
from __future__ import annotations

import torch

BLOCK_ROWS = 16384


def _blocks(b: int):
    for s in range(0, b, BLOCK_ROWS):
        yield s, min(s + BLOCK_ROWS, b)


def masked_whiten_(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """In place: ``x <- (x - mean) / sqrt(var + eps) * m`` over valid entries of ``[B, T]`` ``x``.

    Same result as ``masked_whiten(x, mask) * mask`` (unbiased variance, two passes, float64
    accumulators) with one block-sized temporary instead of full-size ones. Only for tensors the
    caller owns.
    """
    m = mask.to(x.dtype)
    buf = torch.empty((min(BLOCK_ROWS, x.shape[0]), x.shape[-1]), dtype=x.dtype, device=x.device)
    n = m.sum(dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for s, e in _blocks(x.shape[0]):
        total += torch.mul(x[s:e], m[s:e], out=buf[: e - s]).sum(dtype=torch.float64)
    mean = total / n.clamp(min=1)
    ss = torch.zeros((), dtype=torch.float64, device=x.device)
    for s, e in _blocks(x.shape[0]):
        d = torch.sub(x[s:e], mean.to(x.dtype), out=buf[: e - s])
        ss += d.square_().mul_(m[s:e]).sum(dtype=torch.float64)
    var = ss / n.clamp(min=1)
    if n > 1:
        var = var * n / (n - 1)
    return x.sub_(mean.to(x.dtype)).mul_(torch.rsqrt(var + eps).to(x.dtype)).mul_(m)


def gae_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
             lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GAE advantages and returns ``[B, T]`` (both 0 outside the mask); see
    :func:`mrl.algorithms.advantages.compute_gae_advantage_return` for the recursion.
    """
    b, t_len = rewards.shape
    dtype = rewards.dtype
    adv = torch.empty_like(rewards)
    ret = torch.empty_like(rewards)
    rows = min(BLOCK_ROWS, b)
    r_buf, v_buf, m_buf, a_buf = (torch.empty((t_len, rows), dtype=dtype, device=rewards.device) for _ in range(4))
    gl = gamma * lam
    for s, e in _blocks(b):
        n = e - s
        rt, vt, mt, at = r_buf[:, :n], v_buf[:, :n], m_buf[:, :n], a_buf[:, :n]
        rt.copy_(rewards[s:e].t())
        vt.copy_(values[s:e].t())
        mt.copy_(mask[s:e].t())
        next_v = torch.zeros(n, dtype=dtype, device=rewards.device)
        last = torch.zeros_like(next_v)
        cand = torch.empty_like(next_v)
        for t in range(t_len - 1, -1, -1):
            torch.add(rt[t], next_v, alpha=gamma, out=cand).sub_(vt[t]).add_(last, alpha=gl)
            torch.lerp(last, cand, mt[t], out=at[t])  # masked token: carry A over unchanged
            last = at[t]
            next_v.lerp_(vt[t], mt[t])  # masked token: carry V' over unchanged
        adv[s:e].copy_(at.t())
        rt.copy_(at).add_(vt).mul_(mt)  # returns = A + V on valid tokens, reusing the reward buffer
        ret[s:e].copy_(rt.t())
    adv.mul_(mask)
    return adv, ret


def discounted_scan(x: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = lerp(G_next, x_t + gamma G_next, m_t)`` backwards over t, output ``G * m`` ``[B, T]``."""
    b, t_len = x.shape
    out = torch.empty_like(x)
    rows = min(BLOCK_ROWS, b)
    x_buf, m_buf, g_buf = (torch.empty((t_len, rows), dtype=x.dtype, device=x.device) for _ in range(3))
    for s, e in _blocks(b):
        n = e - s
        xt, mt, gt = x_buf[:, :n], m_buf[:, :n], g_buf[:, :n]
        xt.copy_(x[s:e].t())
        mt.copy_(mask[s:e].t())
        run = torch.zeros(n, dtype=x.dtype, device=x.device)
        cand = torch.empty_like(run)
        for t in range(t_len - 1, -1, -1):
            torch.add(xt[t], run, alpha=gamma, out=cand)
            torch.lerp(run, cand, mt[t], out=gt[t])
            run = gt[t]
        out[s:e].copy_(gt.mul_(mt).t())
    return out
