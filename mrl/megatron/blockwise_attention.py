"""Causal attention with sliding windows, attention sinks and an offset query range, without a mask (CPU).

The queries are the last ``sq`` positions ``[P, P + sq)`` of ``sk = P + sq`` keys (a whole sequence: ``P = 0``; a
context-parallel chunk: :mod:`mrl.megatron.context_parallel`). Query ``q`` sees key ``k`` iff ``q − W <= k <= q``
(``W`` = Megatron's left window; no window: ``W = ∞``), and each head may have a sink logit ``s_h`` that joins the
softmax's denominator with no value (gpt-oss). An explicit mask for that (``[sq, sk]``, one more column for the
sink) costs memory quadratic in the sequence and takes SDPA off its flash kernel. Here the queries are cut into
blocks ``[s, e)`` at the multiples of ``W`` (and at ``P``), ``e − s <= W``, whose visible keys are at most three
maskless blocks:

* ``e <= W`` (no query reaches back ``W``): ``[0, s)`` all seen, ``[s, e)`` causal;
* else ``[s − W, e − W)`` anti-causal (query ``s + a`` sees key ``s − W + b`` iff ``b >= a``: causal once both
  are reversed), ``[e − W, s)`` all seen, ``[s, e)`` causal.

Each block is one flash call returning its output ``O_b`` and log-sum-exp ``l_b``; the blocks and the sink merge
exactly::

    L = log(Σ_b e^{l_b} + e^{s_h}),   O = Σ_b e^{l_b − L} O_b

The backward runs each block's flash backward with the merged ``O`` and ``L`` (as ring attention does): the
kernel's ``P_b = exp(scale·Q K_b^T − L)`` are the merged softmax's probabilities on block b and its
``D = rowsum(dO ∘ O)`` the merged one, so ``dQ = Σ_b dQ_b`` and each ``dK_b, dV_b`` are exact; the sink's
gradient is ``−Σ_q e^{s_h − L_q} D_q``.

Uses torch's CPU flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward): one head size
for Q, K and V, no dropout, as many KV heads as query heads (GQA: the caller runs one call per query head of a
KV group).
"""
from __future__ import annotations

import itertools

import torch

Tensor = torch.Tensor
Block = tuple[int, int, str]  # key range [start, end) and kind: "full" | "causal" | "anti"


def plan_blocks(sq: int, sk: int, window: int | None) -> list[tuple[int, int, list[Block]]]:
    """The query blocks ``[s, e)`` (key positions; the queries are the last ``sq`` of ``sk``) and their key
    blocks (see the module docstring)."""
    P = sk - sq
    cuts = {P, sk}
    if window is not None:
        cuts |= set(range((P // window + 1) * window, sk, window))
    bounds = sorted(cuts)
    out = []
    for s, e in itertools.pairwise(bounds):
        if window is None or e <= window:
            blocks = [(0, s, "full"), (s, e, "causal")]
        else:
            blocks = [(s - window, e - window, "anti"), (e - window, s, "full"), (s, e, "causal")]
        out.append((s, e, [(a, b, kind) for a, b, kind in blocks if b > a]))
    return out


def _fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _block_fwd(q: Tensor, k: Tensor, v: Tensor, kind: str, scale: float) -> tuple[Tensor, Tensor]:
    if kind == "anti":  # causal once queries and keys are both reversed
        o, lse = _fwd(q.flip(-2).contiguous(), k.flip(-2).contiguous(), v.flip(-2).contiguous(), True, scale)
        return o.flip(-2), lse.flip(-1)
    return _fwd(q.contiguous(), k.contiguous(), v.contiguous(), kind == "causal", scale)


def _block_bwd(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, kind: str, scale: float
               ) -> tuple[Tensor, Tensor, Tensor]:
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    if kind == "anti":
        f = lambda t: t.flip(-2).contiguous()
        dq, dk, dv = bwd(f(grad), f(q), f(k), f(v), f(out), lse.flip(-1).contiguous(), 0.0, True, scale=scale)
        return dq.flip(-2), dk.flip(-2), dv.flip(-2)
    c = lambda t: t.contiguous()
    return bwd(c(grad), c(q), c(k), c(v), c(out), c(lse), 0.0, kind == "causal", scale=scale)


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sink: Tensor | None, scale: float, window: int | None):
        sq, sk = q.shape[-2], k.shape[-2]
        plan = plan_blocks(sq, sk, window)
        P = sk - sq
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        lse_all = q.new_empty(q.shape[:-1], dtype=torch.float32)
        for s, e, blocks in plan:
            qb = q[..., s - P: e - P, :]
            parts = [_block_fwd(qb, k[..., a:b, :], v[..., a:b, :], kind, scale) for a, b, kind in blocks]
            lses = [lse for _, lse in parts]
            if sink is not None:  # one more term of the denominator, with no value
                lses.append(sink.float().view(1, -1, 1).expand_as(lses[0]))
            lse = torch.logsumexp(torch.stack(lses), 0)
            out[..., s - P: e - P, :] = sum(o * (l_b - lse).exp().unsqueeze(-1) for o, l_b in zip(
                (o for o, _ in parts), lses))
            lse_all[..., s - P: e - P] = lse
        ctx.save_for_backward(q, k, v, out, lse_all, sink)
        ctx.scale, ctx.plan, ctx.P = scale, plan, P
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        P = ctx.P
        for s, e, blocks in ctx.plan:
            rows = slice(s - P, e - P)
            for a, b, kind in blocks:
                gq, gk, gv = _block_bwd(grad[..., rows, :], q[..., rows, :], k[..., a:b, :], v[..., a:b, :],
                                        out[..., rows, :], lse[..., rows], kind, ctx.scale)
                dq[..., rows, :] += gq
                dk[..., a:b, :] += gk
                dv[..., a:b, :] += gv
        dsink = None
        if sink is not None:  # dL/ds_h = −Σ_q P_sink(q) · rowsum(dO ∘ O)(q)
            p_sink = (sink.float().view(1, -1, 1) - lse).exp()
            dsink = -(p_sink * (grad * out).sum(-1).float()).sum((0, 2)).to(sink.dtype)
        return dq, dk, dv, dsink, None, None


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, *, window: int | None = None,
                        sink: Tensor | None = None) -> Tensor:
    """``[b, h, sq, d]`` queries at the last ``sq`` of the ``[b, h, sk, d]`` keys, causal, left window ``window``
    (None: none), per-head sink logits ``sink`` ``[h]`` (None: none) -> ``[b, h, sq, d]``."""
    return _Blockwise.apply(q, k, v, sink, scale, window)


def usable(q: Tensor, dk: int, dv: int) -> bool:
    """Whether :func:`blockwise_attention` runs here: CPU, one head size."""
    return q.device.type == "cpu" and dk == dv
