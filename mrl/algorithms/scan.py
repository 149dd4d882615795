"""Memory-lean kernels behind the estimators: blocked reverse scans over time and in-place whitening.

At 100k samples x 1k tokens every ``[B, T]`` float32 temporary is 400 MB, and on CPU a fresh one
costs page faults on top of the arithmetic. These kernels therefore work on blocks of
``BLOCK_ROWS`` samples, transposed to ``[T, rows]`` in reused buffers (each time step then reads one
contiguous row), and write each result once into its ``[B, T]`` output.
"""
from __future__ import annotations

import torch

BLOCK_ROWS = 16384  # rows per block of the time recursions (per-step ops stay L2-sized)
ELEM_ELEMENTS = 1 << 18  # elements per block of the elementwise passes (about 1 MB of float32)


def _blocks(b: int, rows: int | None = None):
    rows = BLOCK_ROWS if rows is None else rows
    for s in range(0, b, rows):
        yield s, min(s + rows, b)


def _elem_rows(t_len: int) -> int:
    return max(1, ELEM_ELEMENTS // max(t_len, 1))


def moments_to_mean_rstd(n: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, eps: float = 1e-8):
    """Mean and ``1/sqrt(var + eps)`` from float64 ``n = sum m``, ``s1 = sum m x``, ``s2 = sum m x^2``;
    unbiased variance (times ``n / (n - 1)`` when ``n > 1``) as verl's ``masked_whiten``."""
    nn = n.clamp(min=1)
    mean = s1 / nn
    var = (s2 / nn - mean * mean).clamp(min=0)
    if n > 1:
        var = var * n / (n - 1)
    return mean, torch.rsqrt(var + eps)


def masked_whiten_(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """In place: ``x <- (x - mean) / sqrt(var + eps) * m`` over valid entries of ``[B, T]`` ``x``.

    Same result as ``masked_whiten(x, mask) * mask`` (unbiased variance, float64 accumulators),
    computed in cache-sized row blocks: one pass for the moments, one for the update. Only for
    tensors the caller owns.
    """
    m = mask.to(x.dtype)
    rows = _elem_rows(x.shape[-1])
    buf = torch.empty((min(rows, x.shape[0]), x.shape[-1]), dtype=x.dtype, device=x.device)
    s1 = torch.zeros((), dtype=torch.float64, device=x.device)
    s2 = torch.zeros_like(s1)
    for s, e in _blocks(x.shape[0], rows):
        xm = torch.mul(x[s:e], m[s:e], out=buf[: e - s])
        s1 += xm.sum(dtype=torch.float64)
        s2 += xm.mul_(x[s:e]).sum(dtype=torch.float64)
    mean, rstd = moments_to_mean_rstd(m.sum(dtype=torch.float64), s1, s2, eps)
    mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    for s, e in _blocks(x.shape[0], rows):
        x[s:e].sub_(mean).mul_(rstd).mul_(m[s:e])
    return x


def reverse_cumsum_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``G_t = sum_{k >= t} x_k m_k``, times ``m_t``, ``[B, T]``, in cache-sized row blocks."""
    out = torch.empty_like(x)
    rows = _elem_rows(x.shape[-1])
    xb_buf = torch.empty((min(rows, x.shape[0]), x.shape[-1]), dtype=x.dtype, device=x.device)
    for s, e in _blocks(x.shape[0], rows):
        xm = torch.mul(x[s:e], mask[s:e], out=xb_buf[: e - s])
        total = xm.sum(-1, keepdim=True)
        o = torch.cumsum(xm, -1, out=out[s:e])
        # G_t = S - cumsum_t + x_t (no flipped copies)
        torch.sub(total, o, out=o).add_(xm).mul_(mask[s:e])
    return out


def gae_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
             lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GAE advantages (not masked: masked tokens hold the carried value) and returns (0 outside
    the mask), both ``[B, T]``; see
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
