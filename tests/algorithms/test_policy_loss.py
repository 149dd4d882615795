"""Policy losses: worked numbers, dual clip, clip fractions, TIS, GSPO, REINFORCE, micro-batch metrics."""
import math

import pytest
import torch

from mrl.algorithms import (
    LOSS_AGG_MODES,
    PolicyLossOutput,
    count_tokens_and_seqs,
    get_policy_loss_fn,
)

KW = {"loss_agg_mode": "token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}


def _t(x):
    return torch.tensor([x], dtype=torch.float64)


def test_seed_002_ppo_example():
    new = _t([-0.10, -0.06, -0.13, -0.08, -0.03, -0.01])
    old = _t([-0.12, -0.08, -0.15, -0.10, -0.05, -0.02])
    adv = _t([0.13, 0.10, 0.08, 0.05, 0.03, 0.05])
    out = get_policy_loss_fn("vanilla")(old, new, adv, torch.ones_like(adv), **KW)
    assert isinstance(out, PolicyLossOutput)
    assert round(out.pg_loss.item(), 4) == -0.0747
    assert out.pg_clipfrac.item() == 0.0 and out.pg_clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == pytest.approx(-(0.02 * 5 + 0.01) / 6, rel=1e-9)


def test_clip_and_dual_clip_branches():
    # token 0: A>0, r=1.5 -> clipped at 1+0.2;  token 1: A<0, r=0.5 -> clipped at 1-0.2;
    # token 2: A<0, r=5 -> PPO term -A*r = 5 > dual bound -A*c = 3 -> dual clip binds;  token 3: inside.
    ratio = _t([1.5, 0.5, 5.0, 1.1])
    adv = _t([1.0, -1.0, -1.0, 2.0])
    old = torch.zeros_like(ratio)
    out = get_policy_loss_fn("vanilla")(old, ratio.log(), adv, torch.ones_like(adv), **KW)
    # per-token losses: -1*1.2, max(0.5, 0.8)=0.8, min(max(5, 1.2), 3)=3, -2*1.1
    assert out.pg_loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 2.2) / 4, rel=1e-12)
    assert out.pg_clipfrac.item() == pytest.approx(2 / 4)  # tokens 0 and 1 took the clipped term
    assert out.pg_clipfrac_lower.item() == pytest.approx(1 / 4)  # token 2
    no_dual = get_policy_loss_fn("vanilla")(old, ratio.log(), adv, torch.ones_like(adv), **{**KW, "clip_ratio_c": None})
    assert no_dual.pg_loss.item() == pytest.approx((-1.2 + 0.8 + 5.0 - 2.2) / 4, rel=1e-12)
    assert no_dual.pg_clipfrac_lower.item() == 0.0


def test_asymmetric_clip_high():
    ratio, adv = _t([1.25, 1.25]), _t([1.0, 1.0])
    out = get_policy_loss_fn("vanilla")(torch.zeros_like(adv), ratio.log(), adv, torch.ones_like(adv),
                                        **{**KW, "clip_ratio_high": 0.28})
    assert out.pg_loss.item() == pytest.approx(-1.25) and out.pg_clipfrac.item() == 0.0


def test_vanilla_gradient_is_zero_where_clipped():
    ratio, adv = _t([1.5, 1.1]), _t([1.0, 1.0])
    lp = ratio.log().requires_grad_(True)
    get_policy_loss_fn("vanilla")(torch.zeros_like(adv), lp, adv, torch.ones_like(adv), **KW).pg_loss.backward()
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(-1.1 / 2)


def test_bad_clip_settings_name_the_key():
    x = _t([0.0])
    with pytest.raises(ValueError, match="clip_ratio_c"):
        get_policy_loss_fn("vanilla")(x, x, x, torch.ones_like(x), **{**KW, "clip_ratio_c": 0.9})
    with pytest.raises(ValueError, match="rollout_log_probs is None"):
        get_policy_loss_fn("vanilla")(x, x, x, torch.ones_like(x), **KW, tis_imp_ratio_cap=2.0)


def test_truncated_importance_sampling_weights_token_losses():
    old = _t([-1.0, -1.0, -1.0])
    new = old.clone()
    rollout = _t([-1.0, -1.5, -4.0])  # w = exp(old - rollout) = [1, e^0.5, e^3 -> cap 2]
    adv = _t([1.0, 1.0, 1.0])
    for name in ("vanilla", "gspo", "reinforce"):
        out = get_policy_loss_fn(name)(old, new, adv, torch.ones_like(adv), **KW, rollout_log_probs=rollout,
                                       tis_imp_ratio_cap=2.0)
        want = -(1.0 + math.exp(0.5) + 2.0) / 3
        assert out.pg_loss.item() == pytest.approx(want, rel=1e-9), name


def test_gspo_uses_sequence_ratio():
    old = torch.zeros(2, 3, dtype=torch.float64)
    new = torch.tensor([[0.3, -0.1, 0.1], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    lp = new.clone().requires_grad_(True)
    out = get_policy_loss_fn("gspo")(old, lp, adv, mask, **{**KW, "loss_agg_mode": "seq-mean-token-mean"})
    s0 = math.exp(0.1)  # mean of 0.3, -0.1 over the 2 valid tokens
    assert out.pg_loss.item() == pytest.approx((-s0 + 1.0) / 2, rel=1e-9)
    out.pg_loss.backward()
    # d/dlp_t of -A s_i (value s_i, gradient through the token's own log-prob): -A s_i / n_i / S
    assert lp.grad[0, 0].item() == pytest.approx(-s0 / 2 / 2, rel=1e-9)
    assert lp.grad[0, 2].item() == 0.0


def test_reinforce_is_unclipped():
    ratio, adv = _t([3.0, 0.1]), _t([1.0, -1.0])
    lp = ratio.log().requires_grad_(True)
    out = get_policy_loss_fn("reinforce")(torch.zeros_like(adv), lp, adv, torch.ones_like(adv), **KW)
    assert out.pg_loss.item() == pytest.approx((-3.0 + 0.1) / 2)
    out.pg_loss.backward()
    torch.testing.assert_close(lp.grad, -adv * ratio / 2)
    assert out.pg_clipfrac.item() == 0.0


@pytest.mark.parametrize("name", ["vanilla", "gspo", "reinforce"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_full_batch_loss_grad_and_metrics(name, mode):
    g = torch.Generator().manual_seed(7)
    B, T = 10, 8
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    new = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).to(torch.float64)
    kw = {**KW, "loss_agg_mode": mode}
    fn = get_policy_loss_fn(name)
    a = new.clone().requires_grad_(True)
    full = fn(old, a, adv, mask, **kw)
    full.pg_loss.backward()
    tok, seq = count_tokens_and_seqs(mask)
    b = new.clone().requires_grad_(True)
    outs = [fn(o, n, ad, m, **kw, global_tokens=tok, global_seqs=seq)
            for o, n, ad, m in zip(old.chunk(5), b.chunk(5), adv.chunk(5), mask.chunk(5), strict=True)]
    sum(o.pg_loss for o in outs).backward()
    torch.testing.assert_close(sum(o.pg_loss for o in outs), full.pg_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-15)
    for field in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        torch.testing.assert_close(sum(getattr(o, field) for o in outs), getattr(full, field), rtol=1e-6, atol=1e-15)


@pytest.mark.parametrize("tis", [False, True])
@pytest.mark.parametrize("name", ["vanilla", "gspo", "reinforce"])
def test_sum_norm_with_norm_constant_ignores_padding_width(name, tis):
    """Dr.GRPO with C = max_response_length: extra zero-mask columns change neither loss nor gradient.

    float64, rtol 1e-12 (the sums only gain exact zeros). Without ``norm_constant`` the padded
    width is C and the loss moves (what the trainer did before C was passed).
    """
    g = torch.Generator().manual_seed(11)
    B, T, k, C = 6, 7, 5, 20
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    new = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).to(torch.float64)

    def pad(t):  # garbage under the zero mask: it must not leak into loss, gradient or metrics
        return torch.cat([t, -torch.rand(B, k, generator=g, dtype=torch.float64)], dim=-1)

    kw = {**KW, "loss_agg_mode": "seq-mean-token-sum-norm", "norm_constant": C}
    if tis:
        kw["tis_imp_ratio_cap"] = 1.5
    fn = get_policy_loss_fn(name)
    a = new.clone().requires_grad_(True)
    narrow = fn(old, a, adv, mask, **kw, rollout_log_probs=rollout if tis else None)
    narrow.pg_loss.backward()
    b = new.clone().requires_grad_(True)
    wide_mask = torch.cat([mask, torch.zeros(B, k, dtype=torch.float64)], dim=-1)
    wide = fn(pad(old), pad(b), pad(adv), wide_mask, **kw, rollout_log_probs=pad(rollout) if tis else None)
    wide.pg_loss.backward()
    torch.testing.assert_close(wide.pg_loss, narrow.pg_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=0)
    for field in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        torch.testing.assert_close(getattr(wide, field), getattr(narrow, field), rtol=1e-12, atol=0)
    kw_default = {key: v for key, v in kw.items() if key != "norm_constant"}
    default = fn(old, new, adv, mask, **kw_default, rollout_log_probs=rollout if tis else None)
    assert default.pg_loss.item() == pytest.approx(narrow.pg_loss.item() * C / T, rel=1e-12)
