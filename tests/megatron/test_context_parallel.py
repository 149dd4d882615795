"""The zigzag layout of context parallelism (mrl/megatron/context_parallel.py) and the CP path of mrl's SDPA
attention: two gloo ranks hold zigzag shares of one packed row of ragged sequences and must give, per column,
the float64 softmax written out in tests/megatron/test_sdpa_attention.py over the whole row (causal GQA,
d_k != d_v as in MLA, sliding windows, gpt-oss sinks), with gradients of Q, K, V and the sink logits (K/V
gradients come back by the reduce-scatter; the sink gradient is each rank's share, summed here)."""
from __future__ import annotations

import types

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.megatron.test_sdpa_attention import _config, _naive

TOL = 1e-5  # fp32 kernels vs a float64 reference on O(1) values (as test_sdpa_attention)


def test_rank_r_holds_chunks_r_and_its_mirror():
    from mrl.megatron.context_parallel import zigzag_chunks

    assert [zigzag_chunks(2, r) for r in range(2)] == [(0, 3), (1, 2)]
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    for cp in (1, 2, 3, 4, 8):
        held = [j for r in range(cp) for j in zigzag_chunks(cp, r)]
        assert sorted(held) == list(range(2 * cp))  # every chunk once
        # causal work: chunk j attends (j + 1) chunks of keys; every rank gets the same 2·CP + 1
        assert {sum(j + 1 for j in zigzag_chunks(cp, r)) for r in range(cp)} == {2 * cp + 1}
    with pytest.raises(ValueError, match="CP rank 2"):
        zigzag_chunks(2, 2)


def test_local_columns_and_the_global_order():
    from mrl.megatron.context_parallel import global_order, local_columns

    cu = torch.tensor([0, 8, 12, 20])  # chunks of 2, 1 and 2 columns at CP=2
    assert local_columns(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 18, 19]
    assert local_columns(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 14, 15, 16, 17]
    rows = torch.stack([local_columns(cu, 2, r) for r in range(2)])  # what an all-gather stacks
    assert rows.flatten()[global_order(cu, 2)].tolist() == list(range(20))
    with pytest.raises(ValueError, match=r"\[6\] are not multiples of 2\*CP = 4"):
        local_columns(torch.tensor([0, 8, 14]), 2, 0)


CASES = {  # name: (config kwargs, d_k, d_v, layer)
    "causal-gqa": ({}, 16, 16, 1),
    "mla-dims": ({}, 24, 16, 1),
    "window": ({"window": (3, 0), "skip": 2}, 16, 16, 1),
    "sinks+window": ({"window": (3, 0), "skip": 2, "softmax_type": "learnable"}, 16, 16, 1),
}
LENS = [4, 12, 8]  # a packed row of three sequences, multiples of 2·CP = 4 (chunks of 1, 3 and 2 columns)


def _row(dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    return (torch.randn(T, 1, 4, dk, generator=g), torch.randn(T, 1, 2, dk, generator=g),
            torch.randn(T, 1, 2, dv, generator=g), torch.randn(T, 1, 4 * dv, generator=g))


def _cp_rank(rank, world):
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from mrl.megatron.context_parallel import local_columns
    from mrl.megatron.sdpa_attention import SDPAAttention

    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()])
    cols = local_columns(cu, world, rank)
    params = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu.int(), cu_seqlens_kv=cu.int(),
                             max_seqlen_q=max(LENS), max_seqlen_kv=max(LENS))
    out = {}
    for name, (kw, dk, dv, layer) in CASES.items():
        cfg = _config(**kw)
        cfg.context_parallel_size = world
        torch.manual_seed(0)
        attn = SDPAAttention(cfg, layer, AttnMaskType.causal, "self", k_channels=dk, v_channels=dv,
                             pg_collection=types.SimpleNamespace(cp=dist.group.WORLD))
        q, k, v, w = (t[cols].clone().requires_grad_(i < 3) for i, t in enumerate(_row(dk, dv)))
        o = attn(q, k, v, None, packed_seq_params=params)
        (o * w).sum().backward()  # Σ over ranks = the whole row's Σ o·w
        sink = attn.softmax_offset
        out[name] = {"o": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "cols": cols,
                     "sink": None if sink is None else sink.detach(),
                     "dsink": None if sink is None or sink.grad is None else sink.grad}
    return out


def test_cp2_attention_equals_the_whole_row_softmax():
    res = run_ranks(_cp_rank, 2, timeout_s=120)
    T = sum(LENS)
    seq = torch.repeat_interleave(torch.arange(len(LENS)), torch.tensor(LENS))
    pos = torch.cat([torch.arange(n) for n in LENS])
    same = seq[:, None] == seq[None, :]
    causal = same & (pos[None, :] <= pos[:, None])
    for name, (kw, dk, dv, _layer) in CASES.items():
        allowed = causal & (pos[None, :] >= pos[:, None] - kw["window"][0]) if "window" in kw else causal
        q, k, v, w = _row(dk, dv)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        sinks = res[0][name]["sink"]
        sinks = None if sinks is None else sinks.clone().requires_grad_()
        ref = _naive(q, k, v, dk ** -0.5, allowed[None, None], sinks)
        (ref * w.double()).sum().backward()
        for what, full_ref in (("o", ref.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            got = torch.zeros(T, *full_ref.shape[1:], dtype=torch.float64)
            for r in res:
                got[r[name]["cols"]] = r[name][what].double()
            torch.testing.assert_close(got, full_ref.double(), rtol=0, atol=TOL, msg=lambda m, a=f"{name} {what}": f"{a}: {m}")
        if sinks is not None:
            dsink = sum(r[name]["dsink"] for r in res)  # each rank's queries' share (DDP sums it over CP)
            torch.testing.assert_close(dsink.double(), sinks.grad.double(), rtol=0, atol=TOL)
