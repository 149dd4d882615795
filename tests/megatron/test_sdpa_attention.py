"""mrl's SDPA core attention (mrl/megatron/sdpa_attention.py) against a float64 softmax written out here, and
against Megatron's own unfused ``DotProductAttention`` (one gloo rank): causal GQA with the model's scale,
query/key and value head dims that differ (MLA's shape), sliding windows, Megatron-convention masks, and
packed rows whose sequences never see each other (forward and gradients); attention sinks (gpt-oss, Megatron
``softmax_type``) in each of those settings, gradients of the sink logits included."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.dist import run_ranks

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
    """[s, b, h, d] float64 softmax(scale·QKᵀ) V over ``allowed`` [sq, sk] (True = attended), GQA by repetition;
    ``sinks`` [h]: one more logit per head in every softmax, dropped afterwards (transformers' gpt-oss eager)."""
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
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def _qkv(s, b=2, heads=4, groups=2, dk=16, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, d: torch.randn(s, b, h, d, generator=g, requires_grad=True)
    return mk(heads, dk), mk(groups, dk), mk(groups, dv)


def test_causal_gqa_with_the_models_scale_and_different_value_dims():
    cfg = _config()
    q, k, v = _qkv(12, dk=24, dv=16)
    attn = _module(cfg, scale=0.3, k_channels=24, v_channels=16)
    out = attn(q, k, v, None)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    assert out.shape == (12, 2, 4 * 16)
    torch.testing.assert_close(out.double(), _naive(q, k, v, 0.3, causal), rtol=0, atol=TOL)
    default = _module(cfg, k_channels=24, v_channels=16)(q, k, v, None)  # default scale 1/sqrt(d_k)
    torch.testing.assert_close(default.double(), _naive(q, k, v, 1 / math.sqrt(24), causal), rtol=0, atol=TOL)


@pytest.mark.parametrize("layer, windowed", [(1, True), (2, False)])  # every 2nd layer full (window_attn_skip_freq)
def test_sliding_window_follows_megatrons_left_right_convention(layer, windowed):
    q, k, v = _qkv(16)
    out = _module(_config(window=(3, 0), skip=2), layer=layer)(q, k, v, None)
    qi, ki = torch.arange(16)[:, None], torch.arange(16)[None, :]
    allowed = (ki <= qi) & (ki >= qi - 3) if windowed else ki <= qi
    torch.testing.assert_close(out.double(), _naive(q, k, v, 0.25, allowed), rtol=0, atol=TOL)


def test_a_megatron_mask_is_applied_as_given():
    """Megatron's convention: True = not attended (the shared-prefix rows' block mask); per-sample masks [b, 1, s, s]."""
    q, k, v = _qkv(10)
    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(2, 1, 10, 10, generator=g) < 0.6
    allowed |= torch.eye(10, dtype=torch.bool)  # every query sees itself
    out = _module(_config())(q, k, v, ~allowed)
    torch.testing.assert_close(out.double(), _naive(q, k, v, 0.25, allowed), rtol=0, atol=TOL)


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_packed_rows_keep_each_sequence_to_itself(window):
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0, 5, 6, 13, 16]  # sequences of 5, 1 (a lone token), 7 and 3 (e.g. the alignment padding)
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v = _qkv(16, b=1)
    attn = _module(_config(window=window))
    out = attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu,
                                                                 cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7))
    qi, ki = torch.arange(16)[:, None], torch.arange(16)[None, :]
    seg = torch.bucketize(torch.arange(16), torch.tensor(bounds[1:]), right=True)
    allowed = (ki <= qi) & (seg[:, None] == seg[None, :])
    if window:
        allowed &= ki >= qi - window[0]
    torch.testing.assert_close(out.double(), _naive(q, k, v, 0.25, allowed), rtol=0, atol=TOL)
    # gradients: the same as each sequence alone
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = torch.autograd.grad((_naive(q, k, v, 0.25, allowed) * w.double()).sum(), (q, k, v))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=TOL)


def _against_local(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mrl.megatron.parallel import init_parallel

    init_parallel(device="cpu", tp=1, pp=1, timeout_s=60)  # groups, RNG tracker and the CPU redirects
    result = []
    for softmax_type in ("vanilla", "learnable"):  # learnable: Megatron's own sink (SoftmaxOne) vs ours
        cfg = _config(softmax_type=softmax_type)
        q, k, v = _qkv(20)
        local = DotProductAttention(cfg, 1, AttnMaskType.causal, "self")
        ours = _module(cfg)
        params = [(), ()]
        if softmax_type == "learnable":
            with torch.no_grad():
                ours.softmax_offset.copy_(torch.tensor([-2.0, 0.5, 1.0, 3.0]))
                local.softmax_offset.copy_(ours.softmax_offset)
            params = [(local.softmax_offset,), (ours.softmax_offset,)]
        outs = [m(q, k, v, None) for m in (local, ours)]
        grads = [torch.autograd.grad(o.square().sum(), (q, k, v, *p)) for o, p in zip(outs, params)]
        diff = float((outs[0] - outs[1]).abs().max())
        gdiff = max(float((a - b).abs().max()) for a, b in zip(*grads))
        result.append((softmax_type, diff, gdiff, len(grads[0])))
    ps.destroy_model_parallel()
    return result


def test_equals_megatrons_unfused_attention():
    """Also with sinks: the same ``softmax_offset`` gives the same outputs and gradients (its own included)."""
    result = run_ranks(_against_local, 1, timeout_s=120, init_process_group=False)[0]
    assert [(t, n) for t, _, _, n in result] == [("vanilla", 3), ("learnable", 4)]
    for softmax_type, diff, gdiff, _ in result:
        assert diff <= TOL and gdiff <= TOL, (softmax_type, diff, gdiff)


# ---- attention sinks ---------------------------------------------------------------------------
def _sink_module(window=None, skip=None, layer=1, seed=3):
    attn = _module(_config(window=window, skip=skip, softmax_type="learnable"), layer=layer)
    assert isinstance(attn.softmax_offset, torch.nn.Parameter) and attn.softmax_offset.shape == (4,)
    assert attn.softmax_offset.tensor_model_parallel and attn.softmax_offset.partition_dim == 0
    with torch.no_grad():  # one sink far below the scores, one far above (that head attends almost nothing)
        attn.softmax_offset.copy_(torch.tensor([-4.0, 0.3, 1.5, 6.0]))
    return attn


def _assert_grads(out, ref, qkv, sinks, sinks64):
    """Gradients of a random projection of ``out`` (fp32) == those of ``ref`` (float64), the sink logits' too."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out * w).sum(), (*qkv, sinks))
    refs = torch.autograd.grad((ref * w.double()).sum(), (*qkv, sinks64))
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a.double(), b.double(), rtol=0, atol=TOL)
    assert float(refs[3].abs().min()) > 1e-4  # every sink gets a gradient worth checking


@pytest.mark.parametrize("window, layer", [(None, 1), ((3, 0), 1), ((3, 0), 2)])  # layer 2 full: skip freq 2
def test_sinks_join_every_softmax_with_exact_gradients(window, layer):
    q, k, v = _qkv(14)
    attn = _sink_module(window=window, skip=2 if window else None, layer=layer)
    out = attn(q, k, v, None)
    qi, ki = torch.arange(14)[:, None], torch.arange(14)[None, :]
    allowed = ki <= qi
    if window and layer == 1:
        allowed &= ki >= qi - 3
    sinks64 = attn.softmax_offset.detach().double().requires_grad_()
    ref = _naive(q, k, v, 0.25, allowed, sinks64)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOL)
    _assert_grads(out, ref, (q, k, v), attn.softmax_offset, sinks64)


def test_sinks_with_a_megatron_mask_and_in_packed_windowed_rows():
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v = _qkv(10)
    allowed = (torch.rand(2, 1, 10, 10, generator=torch.Generator().manual_seed(1)) < 0.6) | torch.eye(10).bool()
    attn = _sink_module()
    torch.testing.assert_close(attn(q, k, v, ~allowed).double(),
                               _naive(q, k, v, 0.25, allowed, attn.softmax_offset), rtol=0, atol=TOL)
    bounds = [0, 5, 6, 13, 16]
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k, v = _qkv(16, b=1)
    attn = _sink_module(window=(2, 0))
    out = attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu,
                                                                 cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7))
    qi, ki = torch.arange(16)[:, None], torch.arange(16)[None, :]
    seg = torch.bucketize(torch.arange(16), torch.tensor(bounds[1:]), right=True)
    allowed = (ki <= qi) & (ki >= qi - 2) & (seg[:, None] == seg[None, :])
    sinks64 = attn.softmax_offset.detach().double().requires_grad_()
    ref = _naive(q, k, v, 0.25, allowed, sinks64)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=TOL)
    _assert_grads(out, ref, (q, k, v), attn.softmax_offset, sinks64)


def test_off_by_one_is_a_fixed_zero_sink():
    q, k, v = _qkv(8)
    attn = _module(_config(softmax_type="off-by-one"))
    assert not list(attn.parameters())
    torch.testing.assert_close(attn(q, k, v, None).double(),
                               _naive(q, k, v, 0.25, torch.ones(8, 8).bool().tril(), torch.zeros(4)), rtol=0, atol=TOL)
