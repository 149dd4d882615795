"""Memory-lean kernels behind the estimators: blockwise reverse scans over time and whitening.

At 100k samples x 1k tokens every ``[B, T]`` float32 tensor is 400 MB, and on CPU a fresh one
costs page faults on top of the arithmetic. These kernels therefore walk the batch in chunks of
rows that fit in cache, keep the natural ``[B, T]`` layout (no transposes) and write each result
once into its ``[B, T]`` output.

The time recursions ``A_t = x_t + c A_{t+1}`` (``c`` constant: ``gamma`` or ``gamma * lam``) are
solved without a Python loop over t (a parallel-scan formulation, Blelloch 1990): with blocks of
``K = TIME_BLOCK`` steps and ``nb = ceil(T / K)`` blocks,

* within a block, ``A_local = x_block @ U`` with ``U[k, j] = c^(k - j)`` for ``k >= j`` (0 below),
  one GEMM ``[rows * nb, K] @ [K, K]`` for the whole chunk;
* the value entering block ``b`` from the right is
  ``S_b = sum_{k > b} (c^K)^(k - b - 1) A_local[k, 0]``, one GEMM ``[rows, nb] @ [nb, nb]``;
* ``A[b, j] = A_local[b, j] + c^(K - j) S_b``.

For ``c = 1`` the chunk uses ``A_t = S - cumsum_t + x_t`` with ``S`` the last cumsum entry (cheaper
than the GEMMs on CPU, and exactly 0 after the last valid token). Every power is ``c^e`` with
``0 <= e`` and ``c <= 1`` in practice, so nothing is divided and nothing grows; rounding differs from the step-by-step loop only by the summation order (float32 within
1e-5, float64 within 1e-12, tested in ``tests/algorithms/test_scan.py``).

Masks are binary (0/1). The recursions skip masked tokens (see
:func:`mrl.algorithms.advantages.compute_gae_advantage_return`). A chunk whose masks are all
prefixes (``m_it = 1`` for ``t < L_i``, detected exactly by ``sum_t t m_t == L (L - 1) / 2``, which
holds for L distinct positions only when they are ``0..L-1``) is scanned directly; a chunk with holes
(multi-turn observation tokens) is first compacted (valid tokens moved to the front of each row in
order, ``scatter_``), scanned as prefixes and gathered back, which is the same recursion.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK_ROWS = 16384  # upper bound on rows per chunk
ELEM_ELEMENTS = 1 << 18  # elements per chunk: rows = ELEM_ELEMENTS // T (1 MB of float32 per chunk buffer)
TIME_BLOCK = 16  # K: time steps per GEMM block (cost ~ B T (K + T / K) multiply-adds)
_EXACT_F32_INT = 1 << 24  # float32 represents every integer below this exactly


class Moments(NamedTuple):
    """Float64 sums over valid tokens: ``n = sum m``, ``s1 = sum m x``, ``s2 = sum m x^2``."""

    n: float
    s1: float
    s2: float


def _chunk_rows(t_len: int, rows: int | None = None) -> int:
    rows = ELEM_ELEMENTS // max(t_len, 1) if rows is None else rows
    return max(1, min(BLOCK_ROWS, rows))


def _blocks(b: int, rows: int):
    for s in range(0, b, rows):
        yield s, min(s + rows, b)


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
    rows = _chunk_rows(x.shape[-1])
    buf = torch.empty((min(rows, x.shape[0]), x.shape[-1]), dtype=x.dtype, device=x.device)
    n = s1 = s2 = 0.0
    for s, e in _blocks(x.shape[0], rows):
        m = mask[s:e].to(x.dtype)
        xm = torch.mul(x[s:e], m, out=buf[: e - s])
        n += float(m.sum(dtype=torch.float64))
        s1 += float(xm.sum(dtype=torch.float64))
        s2 += float(xm.mul_(x[s:e]).sum(dtype=torch.float64))
    mean, rstd = moments_to_mean_rstd(*(torch.tensor(v, dtype=torch.float64) for v in (n, s1, s2)), eps)
    mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    for s, e in _blocks(x.shape[0], rows):
        x[s:e].sub_(mean).mul_(rstd).mul_(mask[s:e].to(x.dtype))
    return x


def whiten_with_moments(x: torch.Tensor, mask: torch.Tensor, mom: Moments, *, out: torch.Tensor | None = None,
                        eps: float = 1e-8) -> torch.Tensor:
    """``out = (x - mean) * rstd * m`` for ``x`` ``[B, T]`` that is already 0 outside the mask, with
    mean/unbiased variance from ``mom`` (:func:`moments_to_mean_rstd`); ``out=x`` works in place.

    Computed as ``x * rstd - (mean * rstd) m`` (two in-cache passes per row chunk).
    """
    out = torch.empty_like(x) if out is None else out
    mean, rstd = moments_to_mean_rstd(*(torch.tensor(v, dtype=torch.float64) for v in mom), eps)
    shift = -float(mean * rstd)
    rstd_f = float(rstd)
    for s, e in _blocks(x.shape[0], _chunk_rows(x.shape[-1])):
        torch.mul(x[s:e], rstd_f, out=out[s:e]).add_(mask[s:e].to(x.dtype), alpha=shift)
    return out


class _Chunks:
    """Row-chunk workspace for the reverse scan ``A_t = x_t + c A_{t+1}`` over the last dim.

    ``x`` is written into ``self.d[:n, :T]`` (columns ``T..Tp-1`` stay 0, so the GEMM scan past T is
    0); :meth:`scan` returns the ``[n, Tp]`` result buffer, of which callers read ``[:, :T]``.
    Built once per call: ``U`` ``[K, K]``, the block-carry matrix ``[nb, nb]``, ``w`` ``[K]``.
    """

    def __init__(self, c: float, t_len: int, rows: int, dtype: torch.dtype, device: torch.device):
        k = max(1, min(TIME_BLOCK, t_len))
        self.k, self.nb, self.t, self.c = k, -(-t_len // k), t_len, float(c)
        tp = self.nb * k
        c64 = torch.tensor(float(c), dtype=torch.float64)
        j = torch.arange(k, dtype=torch.float64)
        e = j[:, None] - j[None, :]
        self.u = torch.where(e >= 0, c64 ** e.clamp(min=0), 0.0).to(dtype=dtype, device=device)
        bb = torch.arange(self.nb, dtype=torch.float64)
        eb = bb[:, None] - bb[None, :] - 1
        self.m_blk = torch.where(eb >= 0, (c64 ** k) ** eb.clamp(min=0), 0.0).to(dtype=dtype, device=device)
        self.w = (c64 ** (k - j)).to(dtype=dtype, device=device)
        self.d = torch.zeros((rows, tp), dtype=dtype, device=device)
        self.o = torch.empty((rows, tp), dtype=dtype, device=device)
        self.p = torch.empty((rows, t_len), dtype=dtype, device=device)
        # sum_t t m_t in a dtype that holds T^2 exactly (prefix test); L = sum m is exact in float32.
        det = dtype if dtype == torch.float64 or t_len * t_len < _EXACT_F32_INT else torch.float64
        self.det = torch.arange(t_len, dtype=det, device=device)
        self.ar = torch.arange(t_len, device=device)
        self.rc: torch.Tensor | None = None
        self.vc: torch.Tensor | None = None

    def scan(self, n: int) -> torch.Tensor:
        o = self.o[:n]
        if self.c == 1.0:
            # c = 1: G_t = S - cumsum_t + x_t (one sequential cumsum beats the GEMMs here); the
            # padding columns of o are not read (callers use o[:, :T] only).
            d, ot = self.d[:n, : self.t], o[:, : self.t]
            torch.cumsum(d, -1, out=ot)
            # S = last cumsum entry, so past the last valid token S - cumsum_t is exactly 0
            torch.sub(ot[:, -1:].clone(), ot, out=ot).add_(d)
            return o
        torch.mm(self.d[:n].view(-1, self.k), self.u, out=o.view(-1, self.k))
        if self.nb > 1:
            o3 = o.view(n, self.nb, self.k)
            carry = torch.mm(o3[:, :, 0], self.m_blk)  # [n, nb]: value entering each block from the right
            o3.addcmul_(carry.unsqueeze(-1), self.w)
        return o

    def lengths(self, m: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Valid-token counts ``L`` ``[n]`` and whether every row of the binary mask is a prefix."""
        lens = m.sum(-1, dtype=self.det.dtype)
        pos_sum = torch.mv(m.to(self.det.dtype), self.det)
        return lens, bool(torch.equal(pos_sum * 2, lens * (lens - 1)))

    def compact(self, m: torch.Tensor, lens: torch.Tensor, *xs: torch.Tensor):
        """Move each row's valid entries to the front, in order (zeros after): returns the
        compacted ``[n, T]`` views, the prefix mask and ``pos`` ``[n, T]`` (the compacted index of
        token t = valid tokens before t; ``x_c.gather(1, pos) * m`` undoes it)."""
        n, t = m.shape
        if self.rc is None:
            self.rc = torch.empty((self.p.shape[0], t + 1), dtype=self.p.dtype, device=self.p.device)
            self.vc = torch.empty_like(self.rc)
        cm = torch.cumsum(m, -1)
        pos = cm.sub_(m).long()
        tgt = torch.where(m > 0, pos, t)  # masked tokens land in the spare column t
        outs = [buf[:n].zero_().scatter_(1, tgt, x)[:, :t] for buf, x in zip((self.rc, self.vc), xs)]
        mc = (self.ar[None, :] < lens[:, None]).to(m.dtype)
        return outs, mc, pos


def gae_scan(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
             lam: float) -> tuple[torch.Tensor, torch.Tensor, Moments]:
    """Raw GAE advantages ``A * m`` and returns ``(A + V) * m``, both ``[B, T]``, and the moments
    of ``A`` over valid tokens; see :func:`mrl.algorithms.advantages.compute_gae_advantage_return`.

    For a prefix row, ``V'`` of valid token t is ``V_{t+1} m_{t+1}``, so
    ``delta = (r - V) m + gamma * shift(V m)`` and ``A`` is the reverse scan of ``delta`` with
    ``c = gamma * lam`` (0 past the last valid token).
    """
    b, t_len = rewards.shape
    dtype = rewards.dtype
    adv = torch.empty_like(rewards)
    ret = torch.empty_like(rewards)
    if b == 0 or t_len == 0:
        return adv.zero_(), ret.zero_(), Moments(0.0, 0.0, 0.0)
    rows = min(_chunk_rows(t_len), b)
    ws = _Chunks(gamma * lam, t_len, rows, dtype, rewards.device)
    n_tot = s1 = s2 = 0.0
    for s, e in _blocks(b, rows):
        n = e - s
        m = mask[s:e].to(dtype)
        r, v = rewards[s:e], values[s:e]
        lens, prefix = ws.lengths(m)
        if not prefix:
            (r, v), mc, pos = ws.compact(m, lens, r, v)
        else:
            mc = m
        p = torch.mul(v, mc, out=ws.p[:n])
        dt = ws.d[:n, :t_len]
        torch.sub(r, v, out=dt).mul_(mc)
        if t_len > 1:
            dt[:, :-1].add_(p[:, 1:], alpha=gamma)
        o = ws.scan(n)
        a = o[:, :t_len]
        n_tot += float(lens.sum())
        s1 += float(a.sum())
        s2 += float(torch.mul(a, a, out=dt).sum())  # dt is rewritten by the next chunk
        if prefix:
            adv[s:e].copy_(a)
            torch.add(a, p, out=ret[s:e])
        else:
            torch.gather(a, 1, pos, out=adv[s:e]).mul_(m)
            torch.gather(p.add_(a), 1, pos, out=ret[s:e]).mul_(m)
    return adv, ret, Moments(n_tot, s1, s2)


def discounted_scan(x: torch.Tensor, mask: torch.Tensor, gamma: float, *,
                    with_moments: bool = True) -> tuple[torch.Tensor, Moments | None]:
    """``G_t = x_t + gamma G'`` backwards over valid tokens (masked tokens skipped), output
    ``G * m`` ``[B, T]`` and the moments of ``G`` over valid tokens (None if not ``with_moments``).

    With ``gamma = 1`` a skipped token adds nothing, so holes need no compaction:
    ``G_t = sum_{k >= t} x_k m_k``.
    """
    b, t_len = x.shape
    out = torch.empty_like(x)
    if b == 0 or t_len == 0:
        return out.zero_(), Moments(0.0, 0.0, 0.0)
    rows = min(_chunk_rows(t_len), b)
    ws = _Chunks(gamma, t_len, rows, x.dtype, x.device)
    n_tot = s1 = s2 = 0.0
    for s, e in _blocks(b, rows):
        n = e - s
        m = mask[s:e].to(x.dtype)
        if gamma == 1.0:
            lens, prefix = (m.sum(-1) if with_moments else None), True
        else:
            lens, prefix = ws.lengths(m)
        dt = ws.d[:n, :t_len]
        if prefix:
            torch.mul(x[s:e], m, out=dt)
        else:
            (xc,), _, pos = ws.compact(m, lens, x[s:e])
            dt.copy_(xc)  # compacted rows are already 0 past their length
        g = ws.scan(n)[:, :t_len]
        if gamma == 1.0:
            g.mul_(m)  # holes were not compacted: masked tokens hold the carried sum
        if with_moments:
            n_tot += float(lens.sum())
            s1 += float(g.sum())
            s2 += float(torch.mul(g, g, out=dt).sum())  # dt is rewritten by the next chunk
        if prefix:
            out[s:e].copy_(g)
        else:
            torch.gather(g, 1, pos, out=out[s:e]).mul_(m)
    return out, Moments(n_tot, s1, s2) if with_moments else None


def reverse_cumsum_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``G_t = sum_{k >= t} x_k m_k``, times ``m_t``, ``[B, T]`` (the ``gamma = 1`` scan)."""
    return discounted_scan(x, mask, 1.0, with_moments=False)[0]
