"""mrl's SDPA core attention (mrl/megatron/sdpa_attention.py) in the modes tests/megatron/test_sdpa_attention.py does
not run: evaluation mode (``model.eval()``: the old-log-prob, reference and engine-side forwards) and the
``qkv_format="thd"`` packed path multi-latent attention uses (``[T, heads, d]`` tensors, no batch dimension).

Each is checked against a float64 softmax written out here (as in test_sdpa_attention.py; this file stands alone
so that it survives changes there) with the same float32-vs-float64 bound (TOL = 1e-5 on O(1) values: softmax-weighted sums of ≤ 16 keys of 16-wide heads). In eval
mode every feature (causal, sliding window, Megatron mask, packed rows, sinks) must give exactly what it gives in
training mode with no dropout, and attention dropout must switch off.
"""
from __future__ import annotations

import itertools

import pytest
import torch

TOL = 1e-5  # fp32 kernels vs a float64 reference on O(1) values


def _config(window=None, skip=None, heads=4, groups=2, kv=16, softmax_type="vanilla"):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=heads * kv, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=kv, window_size=window, window_attn_skip_freq=skip,
                             use_cpu_initialization=True, attention_dropout=0.0, softmax_type=softmax_type)


def _module(cfg, layer=1, scale=None, k_channels=None, v_channels=None):
    from megatron.core.transformer.enums import AttnMaskType

    from mrl.megatron.sdpa_attention import SDPAAttention

    return SDPAAttention(cfg, layer, AttnMaskType.causal, "self", softmax_scale=scale, k_channels=k_channels,
                         v_channels=v_channels)


def _naive(q, k, v, scale, allowed, sinks=None):
    """[s, b, h, d] float64 softmax(scale·QKᵀ) V over ``allowed`` [sq, sk] or [b, 1, sq, sk] (True = attended), GQA
    by repetition; ``sinks`` [h]: one more logit per head in every softmax, dropped afterwards (gpt-oss)."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, col], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(q.shape[0], q.shape[1], -1)


def _qkv(s, b=2, heads=4, groups=2, dk=16, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, d: torch.randn(s, b, h, d, generator=g, requires_grad=True)
    return mk(heads, dk), mk(groups, dk), mk(groups, dv)


BOUNDS = [0, 5, 6, 13, 16]  # packed sequences of 5, 1 (a lone token), 7 and 3


def _packed_params(fmt: str, bounds=BOUNDS):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    return PackedSeqParams(qkv_format=fmt, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _packed_allowed(n: int, bounds=BOUNDS, left=None) -> torch.Tensor:
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seg = torch.bucketize(torch.arange(n), torch.tensor(bounds[1:]), right=True)
    allowed = (ki <= qi) & (seg[:, None] == seg[None, :])
    return allowed & (ki >= qi - left) if left is not None else allowed


def _with_sinks(attn):
    with torch.no_grad():
        attn.softmax_offset.copy_(torch.tensor([-4.0, 0.3, 1.5, 6.0]))
    return attn


CASES = {  # name: (config kwargs, layer, packed, Megatron mask)
    "causal": ({}, 1, False, False),
    "window": ({"window": (3, 0), "skip": 2}, 1, False, False),
    "mask": ({}, 1, False, True),
    "packed": ({"window": (2, 0)}, 1, True, False),
    "sinks": ({"softmax_type": "learnable"}, 1, False, False),
    "sinks+window": ({"softmax_type": "learnable", "window": (3, 0), "skip": 2}, 1, False, False),
    "sinks+mask": ({"softmax_type": "learnable"}, 1, False, True),
    "sinks+packed": ({"softmax_type": "learnable", "window": (2, 0)}, 1, True, False),
    "off-by-one": ({"softmax_type": "off-by-one"}, 1, False, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_eval_mode_computes_what_training_mode_computes(name):
    kw, layer, packed, masked = CASES[name]
    s = 16 if packed else 12
    q, k, v = _qkv(s, b=1 if packed else 2)
    attn = _module(_config(**kw), layer=layer)
    sinks = None
    if kw.get("softmax_type") == "learnable":
        sinks = _with_sinks(attn).softmax_offset.detach()
    elif kw.get("softmax_type") == "off-by-one":
        sinks = torch.zeros(4)
    qi, ki = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed, mask, call = ki <= qi, None, {}
    if "window" in kw:
        allowed = allowed & (ki >= qi - kw["window"][0])
    if packed:
        allowed, call = _packed_allowed(s, left=kw["window"][0]), {"packed_seq_params": _packed_params("sbhd")}
    if masked:
        allowed = (torch.rand(2, 1, s, s, generator=torch.Generator().manual_seed(1)) < 0.6) | torch.eye(s).bool()
        mask = ~allowed
    ref = _naive(q, k, v, 0.25, allowed, sinks)
    attn.eval()
    assert not attn.training
    with torch.no_grad():
        out_eval = attn(q, k, v, mask, **call)
    attn.train()
    out_train = attn(q, k, v, mask, **call)
    torch.testing.assert_close(out_eval.double(), ref, rtol=0, atol=TOL, msg=lambda m: f"eval, {name}: {m}")
    torch.testing.assert_close(out_eval, out_train.detach(), rtol=0, atol=TOL, msg=lambda m: f"eval vs train: {m}")


def test_eval_mode_turns_attention_dropout_off():
    """With attention dropout 0.5, training mode drops probabilities (the output moves far from the reference) and
    evaluation mode does not (the output is the reference's)."""
    cfg = _config()
    cfg.attention_dropout = 0.5
    attn = _module(cfg)
    q, k, v = _qkv(12)
    ref = _naive(q, k, v, 0.25, torch.ones(12, 12, dtype=torch.bool).tril())
    torch.manual_seed(0)
    train = attn.train()(q, k, v, None)
    assert float((train.double() - ref).abs().max()) > 0.1, "dropout 0.5 left training mode's output unchanged"
    torch.testing.assert_close(attn.eval()(q, k, v, None).double(), ref, rtol=0, atol=TOL)


def _thd(T, heads=4, groups=4, dk=24, dv=16, seed=0):
    """[T, h, d] query/key/value (MLA: as many KV heads as query heads, d_k != d_v)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, d: torch.randn(T, h, d, generator=g, requires_grad=True)
    return mk(heads, dk), mk(groups, dk), mk(groups, dv)


@pytest.mark.parametrize("train", [True, False])
def test_thd_packed_rows_as_multi_latent_attention_hands_them_over(train):
    """``qkv_format="thd"``: [T, heads, d] in, [T, heads · d_v] out, each sequence causal and alone (a one-token
    sequence included), the model's scale, d_k (24) != d_v (16); forward and gradients against float64."""
    q, k, v = _thd(16)
    attn = _module(_config(groups=4), scale=0.3, k_channels=24, v_channels=16).train(train)
    out = attn(q, k, v, None, packed_seq_params=_packed_params("thd"))
    assert out.shape == (16, 4 * 16)
    allowed = _packed_allowed(16)
    # the reference takes [s, b, h, d]: the row is one batch entry
    ref = _naive(q[:, None], k[:, None], v[:, None], 0.3, allowed).reshape(16, 4 * 16)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOL)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    refs = torch.autograd.grad((ref * w.double()).sum(), (q, k, v))
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=TOL)
    # the check's power: one sequence's queries see only their own keys (the lone token attends to itself alone)
    torch.testing.assert_close(out[5].double().view(4, 16), v[5].double(), rtol=0, atol=TOL)


def test_thd_equals_the_sbhd_packed_row():
    """The same packed row handed over as THD (MLA) and as SBHD with one row (the other models): the same output."""
    q, k, v = _thd(16, groups=2, dk=16, dv=16)
    attn = _module(_config())
    thd = attn(q, k, v, None, packed_seq_params=_packed_params("thd"))
    sbhd = attn(q[:, None], k[:, None], v[:, None], None, packed_seq_params=_packed_params("sbhd"))
    torch.testing.assert_close(thd, sbhd.reshape(16, -1), rtol=0, atol=0)
