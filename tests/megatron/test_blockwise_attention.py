"""The maskless prefix + diagonal attention of a CP query chunk (mrl/megatron/blockwise_attention.py) against a float64
softmax over the end-aligned causal mask written out here: outputs and the gradients of Q and of both key/value
blocks, for an empty-ish and a long prefix."""
from __future__ import annotations

import pytest
import torch

TOL = 1e-5  # fp32 flash kernels vs float64 on O(1) values


@pytest.mark.parametrize("c, prefix", [(3, 1), (5, 15), (8, 24)])
def test_prefix_and_diagonal_is_one_causal_softmax(c: int, prefix: int) -> None:
    from mrl.megatron.blockwise_attention import prefix_and_diagonal

    g = torch.Generator().manual_seed(c + prefix)
    n, scale = prefix + c, 0.3
    q = torch.randn(1, 4, c, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 4, n, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 4, n, 16, generator=g, requires_grad=True)
    w = torch.randn(1, 4, c, 16, generator=g)
    out = prefix_and_diagonal(q, k[..., :prefix, :], v[..., :prefix, :], k[..., prefix:, :], v[..., prefix:, :], scale)
    (out * w).sum().backward()
    got = (out.detach(), q.grad, k.grad, v.grad)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    allowed = torch.arange(n)[None, :] <= torch.arange(c)[:, None] + prefix  # queries at the keys' end
    scores = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    ref = scores.softmax(-1) @ vd
    (ref * w.double()).sum().backward()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=TOL, msg=lambda m, x=name: f"{x}: {m}")
