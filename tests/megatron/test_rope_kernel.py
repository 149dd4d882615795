"""mrl/megatron/rope_kernel.py: the one-function RoPE equals Megatron's unfused
``_apply_rotary_pos_emb_bshd`` in value and gradient, with a shared [L, 1, 1, d] table and the
shared-prefix layout's per-sample [L, b, 1, d] table, in fp32 and bf16; the cases it does not cover
go to Megatron's function; cpu_support installs it and undoes it."""
from __future__ import annotations

import pytest
import torch


def _megatron():
    from megatron.core.models.common.embeddings import rope_utils

    return getattr(rope_utils._apply_rotary_pos_emb_bshd, "mrl_original", rope_utils._apply_rotary_pos_emb_bshd)


def _case(per_sample: bool, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    L, b, h, d = 7, 3, 4, 16
    t = torch.randn(L, b, h, d, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.randint(0, 50, (L, b if per_sample else 1), generator=g).float()
    ang = pos[..., None] * inv  # [L, b|1, d/2]
    freqs = torch.cat([ang, ang], -1)[:, :, None, :]  # Megatron's table: [L, b|1, 1, d]
    return t, freqs, torch.randn(L, b, h, d, generator=g).to(dtype)


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rope_kernel_equals_megatron_value_and_gradient(per_sample, dtype, tol):
    from mrl.megatron.rope_kernel import make_rope_bshd

    ref_fn = _megatron()
    ours_fn = make_rope_bshd(ref_fn)
    t, freqs, gy = _case(per_sample, dtype)
    outs = []
    for fn in (ref_fn, ours_fn):
        x = t.clone().requires_grad_(True)
        y = fn(x, freqs, mscale=1.0)
        y.backward(gy)
        outs.append((y.detach().float(), x.grad.float()))
    (y0, g0), (y1, g1) = outs
    assert y1.shape == y0.shape and g1.shape == g0.shape
    assert (y1 - y0).abs().max().item() <= tol * max(1.0, y0.abs().max().item())
    assert (g1 - g0).abs().max().item() <= tol * max(1.0, g0.abs().max().item())
    # a second call with the same table object reuses its cos/sin and gives the same values
    assert torch.equal(ours_fn(t, freqs).float(), y1)


def test_rope_kernel_mscale_and_fallbacks():
    from mrl.megatron.rope_kernel import make_rope_bshd

    calls = []
    ref_fn = _megatron()

    def spy(*a, **k):
        calls.append(k)
        return ref_fn(*a, **k)

    ours = make_rope_bshd(spy)
    t, freqs, _ = _case(False, torch.float32)
    assert torch.allclose(ours(t, freqs, mscale=0.7), ref_fn(t, freqs, mscale=0.7), atol=1e-6)
    assert calls == []
    ours(t, freqs, rotary_interleaved=True)  # interleaved layout, partial rotary: Megatron's own function
    ours(torch.randn(7, 3, 4, 24), freqs)
    assert [c["rotary_interleaved"] for c in calls] == [True, False]


def test_cpu_support_installs_the_kernel_and_undoes_it():
    from megatron.core.models.common.embeddings import rope_utils

    from mrl.megatron.cpu_support import cpu_support

    before = rope_utils._apply_rotary_pos_emb_bshd  # patched already if this process enabled cpu support for good
    with cpu_support():
        assert rope_utils._apply_rotary_pos_emb_bshd.mrl_original is getattr(before, "mrl_original", before)
    assert rope_utils._apply_rotary_pos_emb_bshd is before
