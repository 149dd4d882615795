"""Causal attention of a query chunk over a key prefix plus its own diagonal block, without a mask (CPU).

Context parallelism (:mod:`mrl.megatron.context_parallel`) gives a rank query chunk ``j`` of a sequence: ``c`` queries
at positions ``[j·c, (j+1)·c)`` that see every key of the prefix ``[0, j·c)`` and the keys of their own chunk
causally. An explicit ``[c, (j+1)·c]`` mask would cost memory quadratic in the sequence (and the CPU kernel turns it
into a float mask it keeps for the backward). Instead the two blocks run as two maskless flash calls — the prefix
with no mask, the diagonal with ``is_causal`` (``c`` queries and ``c`` keys: top-left and bottom-right alignment
agree) — each returning its log-sum-exp ``l_b``, merged exactly::

    L = log(e^{l_1} + e^{l_2}),   O = e^{l_1 - L} O_1 + e^{l_2 - L} O_2

The backward runs each block's flash backward with the merged ``O`` and ``L`` (as ring attention does): the
kernel's ``P_b = exp(scale·Q K_b^T − L)`` are then the merged softmax's probabilities on block b and its
``D = rowsum(dO ∘ O)`` the merged one, so ``dQ = Σ_b dQ_b`` and ``dK_b, dV_b`` are exact.

Uses torch's CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward); one head
size for Q, K and V, no dropout, heads already expanded for GQA.
"""
from __future__ import annotations

import torch

Tensor = torch.Tensor


def _fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


class _PrefixAndDiagonal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, kp: Tensor, vp: Tensor, kd: Tensor, vd: Tensor, scale: float) -> Tensor:
        q, kp, vp, kd, vd = (t.contiguous() for t in (q, kp, vp, kd, vd))
        o1, l1 = _fwd(q, kp, vp, False, scale)
        o2, l2 = _fwd(q, kd, vd, True, scale)
        lse = torch.logaddexp(l1, l2)
        out = (o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)).to(q.dtype).contiguous()
        ctx.save_for_backward(q, kp, vp, kd, vd, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, kp, vp, kd, vd, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq1, dkp, dvp = bwd(grad, q, kp, vp, out, lse, 0.0, False, scale=ctx.scale)
        dq2, dkd, dvd = bwd(grad, q, kd, vd, out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, dkp, dvp, dkd, dvd, None


def prefix_and_diagonal(q: Tensor, kp: Tensor, vp: Tensor, kd: Tensor, vd: Tensor, scale: float) -> Tensor:
    """``[b, h, c, d]`` queries over the prefix keys ``kp, vp`` ``[b, h, P, d]`` (all seen) and the diagonal block
    ``kd, vd`` ``[b, h, c, d]`` (causal) -> ``[b, h, c, d]``, as one softmax over both."""
    return _PrefixAndDiagonal.apply(q, kp, vp, kd, vd, scale)


def usable(q: Tensor, dk: int, dv: int) -> bool:
    """Whether :func:`prefix_and_diagonal` runs here: CPU, one head size."""
    return q.device.type == "cpu" and dk == dv
