"""Maskless blockwise attention (mrl/megatron/blockwise_attention.py) against a float64 softmax over the mask written
out here: causal, queries at the keys' end (a context-parallel chunk) or the whole sequence, left windows (several
blocks, a last block shorter than the window, queries starting before and after the window), and per-head sinks
joining every denominator — outputs and the gradients of Q, K, V and the sinks."""
from __future__ import annotations

import pytest
import torch

TOL = 1e-5  # fp32 flash kernels vs float64 on O(1) values


def _reference(q, k, v, scale, window, sink):
    sq, sk = q.shape[-2], k.shape[-2]
    qi, ki = torch.arange(sq)[:, None] + (sk - sq), torch.arange(sk)[None, :]
    allowed = (ki <= qi) & ((ki >= qi - window) if window is not None else True)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    if sink is not None:
        col = sink.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.cat([scores, col], -1).softmax(-1)[..., :-1] @ v
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("sq, sk, window, sinks", [
    (8, 8, None, False), (5, 20, None, False), (8, 32, None, True),  # causal, CP-chunk shapes, sinks
    (23, 23, 4, False), (23, 23, 4, True), (6, 30, 4, True), (3, 9, 5, True), (16, 16, 16, False),
])
def test_blockwise_equals_the_masked_softmax(sq: int, sk: int, window: int | None, sinks: bool) -> None:
    from mrl.megatron.blockwise_attention import blockwise_attention

    g = torch.Generator().manual_seed(sq * 100 + sk)
    scale = 0.3
    q = torch.randn(2, 4, sq, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 4, sk, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 4, sk, 16, generator=g, requires_grad=True)
    sink = (torch.randn(4, generator=g) * 2).requires_grad_() if sinks else None
    w = torch.randn(2, 4, sq, 16, generator=g)
    out = blockwise_attention(q, k, v, scale, window=window, sink=sink)
    (out * w).sum().backward()
    got = [out.detach(), q.grad, k.grad, v.grad] + ([sink.grad] if sinks else [])
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sd = sink.detach().double().requires_grad_() if sinks else None
    ref = _reference(*leaves, scale, window, sd)
    (ref * w.double()).sum().backward()
    want = [ref.detach()] + [t.grad for t in leaves] + ([sd.grad] if sinks else [])
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=TOL, msg=lambda m, x=name: f"{x}: {m}")
