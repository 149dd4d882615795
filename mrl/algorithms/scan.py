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

The carries are computed first (``A_local[k, 0] = x_block . (c^0, ..., c^(K-1))``, one GEMV) and
``c S_b`` is added to the last input of block b, so the one block GEMM yields ``A`` directly
(exactly 0 after the last valid token: the carries there are sums of zeros). For ``c = 1`` the
chunk uses ``A_t = S - cumsum_t + x_t`` with ``S`` the last cumsum entry (cheaper than the GEMMs on
CPU, and also exactly 0 after the last valid token). Every power is ``c^e`` with ``0 <= e`` and ``c <= 1`` in practice, so nothing is divided
and nothing grows; rounding differs from the step-by-step loop only by the summation order
(float32 within 1e-5, float64 within 1e-12, tested in ``tests/algorithms/test_scan.py``).

Chunks are independent: with ``torch.get_num_threads() > 1`` they are shared out to that many
worker threads, each computing its chunks with one intra-op thread (:func:`map_chunks`), and the
per-chunk moments are added in chunk order, so results are bit-identical for any thread count.

Masks are binary (0/1). The recursions skip masked tokens (see
:func:`mrl.algorithms.advantages.compute_gae_advantage_return`). A chunk whose masks are all
prefixes (``m_it = 1`` for ``t < L_i``, detected exactly by ``sum_t t m_t == L (L - 1) / 2``, which
holds for L distinct positions only when they are ``0..L-1``) is scanned directly; a chunk with holes
(multi-turn observation tokens) is first compacted (valid tokens moved to the front of each row in
order, ``scatter_``), scanned as prefixes and gathered back, which is the same recursion.
"""
from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import torch

BLOCK_ROWS = 16384  # upper bound on rows per chunk
ELEM_ELEMENTS = 1 << 18  # elements per chunk: rows = ELEM_ELEMENTS // T (1 MB of float32 per chunk buffer)
TIME_BLOCK = 16  # K: time steps per GEMM block (cost ~ B T (K + T / K) multiply-adds)
_EXACT_F32_INT = 1 << 24  # float32 represents every integer below this exactly

_R = TypeVar("_R")


class Moments(NamedTuple):
    """Float64 sums over valid tokens: ``n = sum m``, ``s1 = sum m x``, ``s2 = sum m x^2``."""

    n: float
    s1: float
    s2: float


def _sum_moments(parts: Sequence[tuple[float, float, float]]) -> Moments:
    """Per-chunk moments added in chunk order (the same sum whichever thread ran which chunk)."""
    n = s1 = s2 = 0.0
    for pn, p1, p2 in parts:
        n, s1, s2 = n + pn, s1 + p1, s2 + p2
    return Moments(n, s1, s2)


def _chunk_rows(t_len: int, rows: int | None = None) -> int:
    rows = ELEM_ELEMENTS // max(t_len, 1) if rows is None else rows
    return max(1, min(BLOCK_ROWS, rows))


def _blocks(b: int, rows: int):
    for s in range(0, b, rows):
        yield s, min(s + rows, b)


def empty_output(shape: tuple[int, int], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Uninitialised contiguous output on ``like``'s device, of ``dtype`` (default ``like.dtype``).

    Written exactly once by the kernels. (Allocating large CPU outputs through numpy, which asks for
    transparent huge pages, made a streaming write cheaper but the chunked kernels slower and erratic:
    2 MB faults in the middle of the chunk loop, and slow first touches of never-used guest memory;
    the figures: docs/algorithms.md, 'Benchmark', 'Tried and not kept'.)
    """
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, executor)
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """Process-wide worker threads whose torch ops run with one intra-op thread.

    ``torch.set_num_threads(1)`` in a worker sets that thread's OpenMP/MKL thread count (thread
    local) and torch's process-wide default; the caller's value is restored before any work runs,
    so the caller's own thread count is unchanged. Rebuilt after ``fork`` (threads do not survive it).
    """
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < workers:
            if _POOL is not None and _POOL[0] == os.getpid():
                _POOL[2].shutdown(wait=False)
            n0 = torch.get_num_threads()
            ready = threading.Barrier(workers + 1, timeout=120)

            def init() -> None:
                torch.get_num_threads()  # runs this thread's one-time lazy init (which would reset it)
                torch.set_num_threads(1)
                ready.wait()

            ex = ThreadPoolExecutor(workers, thread_name_prefix="mrl-scan", initializer=init)
            for _ in range(workers):  # each start blocks in init() until all have started
                ex.submit(int)
            ready.wait()
            torch.set_num_threads(n0)
            _POOL = (os.getpid(), workers, ex)
        return _POOL[2]


def map_chunks(b: int, rows: int, make_ws: Callable[[], object],
               body: Callable[[object, int, int], _R], device: torch.device) -> list[_R]:
    """``[body(ws, s, e) for (s, e) in row chunks of `rows`]``, in chunk order.

    On CPU with ``torch.get_num_threads() > 1`` the chunks are shared out to that many worker
    threads (torch ops release the GIL), each with its own workspace ``make_ws()`` and one intra-op
    thread, so every chunk is computed exactly as with ``torch.set_num_threads(1)``: the result
    does not depend on the thread count. Otherwise the chunks run here, in order. Workers run
    under ``no_grad`` and, if the caller is in ``torch.inference_mode``, in inference mode too
    (outputs allocated there are inference tensors, which only inference mode may write).
    """
    chunks = list(_blocks(b, rows))
    workers = min(torch.get_num_threads(), len(chunks)) if device.type == "cpu" else 1
    if torch.get_num_threads() <= 1 or workers < 1 or device.type != "cpu":
        ws = make_ws()
        return [body(ws, s, e) for s, e in chunks]
    results: list = [None] * len(chunks)
    nxt = itertools.count()  # next() is atomic under the GIL: dynamic load balance
    inference = torch.is_inference_mode_enabled()  # grad modes are thread-local: carry the caller's

    def work() -> None:
        ws = make_ws()
        with torch.inference_mode(inference), torch.no_grad():
            for i in iter(lambda: next(nxt), None):
                if i >= len(chunks):
                    return
                results[i] = body(ws, *chunks[i])

    futs = [_pool(workers).submit(work) for _ in range(workers)]
    for f in futs:
        f.result()
    return results


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

    Computed as ``x * rstd - (mean * rstd) m`` (two in-cache passes per row chunk, chunks shared
    out by :func:`map_chunks`).
    """
    out = empty_output(tuple(x.shape), x) if out is None else out
    mean, rstd = moments_to_mean_rstd(*(torch.tensor(v, dtype=torch.float64) for v in mom), eps)
    shift = -float(mean * rstd)
    rstd_f = float(rstd)

    def body(_ws, s: int, e: int) -> None:
        torch.mul(x[s:e], rstd_f, out=out[s:e]).add_(mask[s:e].to(x.dtype), alpha=shift)

    map_chunks(x.shape[0], _chunk_rows(x.shape[-1]), lambda: None, body, x.device)
    return out


class _Chunks:
    """Row-chunk workspace for the reverse scan ``A_t = x_t + c A_{t+1}`` over the last dim.

    ``x`` is written into ``self.d[:n, :T]`` (columns ``T..Tp-1`` stay 0, so the GEMM scan past T is
    0); :meth:`scan` returns the ``[n, Tp]`` result buffer, of which callers read ``[:, :T]``.
    Built once per call: ``U`` ``[K, K]``, its first column ``u0`` ``[K]``, the block-carry matrix
    ``[nb, nb]``.
    """

    def __init__(self, c: float, t_len: int, rows: int, dtype: torch.dtype, device: torch.device):
        k = max(1, min(TIME_BLOCK, t_len))
        self.k, self.nb, self.t, self.c = k, -(-t_len // k), t_len, float(c)
        tp = self.nb * k
        c64 = torch.tensor(float(c), dtype=torch.float64)
        j = torch.arange(k, dtype=torch.float64)
        e = j[:, None] - j[None, :]
        u = torch.where(e >= 0, c64 ** e.clamp(min=0), 0.0)
        self.u = u.to(dtype=dtype, device=device)
        self.u0 = u[:, 0].to(dtype=dtype, device=device)  # c^k: x_block . u0 = A_local at the block start
        bb = torch.arange(self.nb, dtype=torch.float64)
        eb = bb[:, None] - bb[None, :] - 1
        self.m_blk = torch.where(eb >= 0, (c64 ** k) ** eb.clamp(min=0), 0.0).to(dtype=dtype, device=device)
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
        """Reverse scan of ``self.d[:n]`` (which it may overwrite) into ``self.o[:n]`` ``[n, Tp]``.

        ``c = 1``: the cumsum form (module docstring). Otherwise:

        The carries are computed first, from the block starts ``z_b = x_block . u0`` (one GEMV) and
        ``S = z @ m_blk`` (``S_b`` = value entering block b from the right); adding ``c S_b`` to the
        block's last input makes the one block GEMM produce the final values
        (``A_local[j] + c^(K-1-j) c S_b``), so no pass over the chunk is spent on the carries.
        Exactly 0 after the last nonzero input of a row (the carries there are sums of zeros).
        """
        if self.c == 1.0:
            # c = 1: A_t = S - cumsum_t + x_t with S the last cumsum entry (one sequential cumsum is
            # cheaper than the GEMMs here); S - cumsum_t is exactly 0 past the last nonzero input.
            # The padding columns of o are not read (callers use o[:, :T] only).
            d, ot = self.d[:n, : self.t], self.o[:n, : self.t]
            torch.cumsum(d, -1, out=ot)
            torch.sub(ot[:, -1:].clone(), ot, out=ot).add_(d)
            return self.o[:n]
        d2 = self.d[:n].view(-1, self.k)
        if self.nb > 1:
            z = torch.mv(d2, self.u0).view(n, self.nb)
            carry = torch.mm(z, self.m_blk)  # [n, nb]; its last column is exactly 0
            self.d[:n].view(n, self.nb, self.k)[:, :, -1].add_(carry, alpha=self.c)
        o = self.o[:n]
        torch.mm(d2, self.u, out=o.view(-1, self.k))
        return o

    def lengths(self, m: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Valid-token counts ``L`` ``[n]`` and whether every row of the binary mask is a prefix."""
        lens = m.sum(-1, dtype=self.det.dtype)
        pos_sum = torch.mv(m if m.dtype == self.det.dtype else m.to(self.det.dtype), self.det)
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

    For a prefix row, ``V'`` of valid token t is ``V_{t+1} m_{t+1}``, so with ``P = V m``
    ``delta = r m - P + gamma * shift(P)`` and ``A`` is the reverse scan of ``delta`` with
    ``c = gamma * lam`` (0 past the last valid token). The chunk scans ``-delta``
    (``P - r m`` is one ``addcmul``) and writes ``A = -scan`` and ``A + P = P - scan``.
    """
    b, t_len = rewards.shape
    dtype = rewards.dtype
    adv = empty_output((b, t_len), rewards)
    ret = empty_output((b, t_len), rewards)
    if b == 0 or t_len == 0:
        return adv.zero_(), ret.zero_(), Moments(0.0, 0.0, 0.0)
    rows = min(_chunk_rows(t_len), b)

    def body(ws: _Chunks, s: int, e: int) -> tuple[float, float, float]:
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
        torch.addcmul(p, r, mc, value=-1.0, out=dt)  # -delta without the next-value term
        if t_len > 1:
            dt[:, :-1].sub_(p[:, 1:], alpha=gamma)
        a = ws.scan(n)[:, :t_len]  # -A
        mom = (float(lens.sum()), -float(a.sum()), float(torch.mul(a, a, out=dt).sum()))  # dt is free now
        if prefix:
            torch.neg(a, out=adv[s:e])
            torch.sub(p, a, out=ret[s:e])
        else:
            torch.gather(a, 1, pos, out=adv[s:e]).mul_(m).neg_()
            torch.gather(p.sub_(a), 1, pos, out=ret[s:e]).mul_(m)
        return mom

    parts = map_chunks(b, rows, lambda: _Chunks(gamma * lam, t_len, rows, dtype, rewards.device), body,
                       rewards.device)
    return adv, ret, _sum_moments(parts)


def discounted_scan(x: torch.Tensor, mask: torch.Tensor, gamma: float, *,
                    with_moments: bool = True) -> tuple[torch.Tensor, Moments | None]:
    """``G_t = x_t + gamma G'`` backwards over valid tokens (masked tokens skipped), output
    ``G * m`` ``[B, T]`` and the moments of ``G`` over valid tokens (None if not ``with_moments``).

    With ``gamma = 1`` a skipped token adds nothing, so holes need no compaction:
    ``G_t = sum_{k >= t} x_k m_k``.
    """
    b, t_len = x.shape
    out = empty_output((b, t_len), x)
    if b == 0 or t_len == 0:
        return out.zero_(), Moments(0.0, 0.0, 0.0)
    rows = min(_chunk_rows(t_len), b)

    def body(ws: _Chunks, s: int, e: int) -> tuple[float, float, float] | None:
        n = e - s
        m = mask[s:e].to(x.dtype)
        if gamma == 1.0:
            lens, prefix = None, True
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
            g = torch.mul(g, m, out=out[s:e])  # holes were not compacted: masked tokens hold the carried sum
        elif prefix:
            out[s:e].copy_(g)
        else:
            torch.gather(g, 1, pos, out=out[s:e]).mul_(m)
        if not with_moments:
            return None
        n_valid = float(m.sum()) if lens is None else float(lens.sum())
        return n_valid, float(g.sum()), float(torch.mul(g, g, out=dt).sum())  # dt is free now

    parts = map_chunks(b, rows, lambda: _Chunks(gamma, t_len, rows, x.dtype, x.device), body, x.device)
    return out, _sum_moments(parts) if with_moments else None


def reverse_cumsum_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``G_t = sum_{k >= t} x_k m_k``, times ``m_t``, ``[B, T]`` (the ``gamma = 1`` scan)."""
    return discounted_scan(x, mask, 1.0, with_moments=False)[0]
