"""vocab_parallel_log_probs against the full-vocab torch reference (values and gradients).

Reference: ``torch.log_softmax`` on the gathered, un-padded logits divided by the temperature;
entropy ``-sum p log p``; gradients from autograd through that reference. Float64 tolerance 1e-10.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from mrl.megatron.vocab_parallel import vocab_parallel_log_probs
from tests.helpers.dist import run_ranks

F64_TOL = 1e-10
V_LOCAL = 8
IGNORE = -100


def _inputs(v_pad: int, vocab_size: int, dtype: torch.dtype, seed: int = 0):
    """Full logits [2, 5, v_pad] (same on every rank), labels [2, 5], loss weights [2, 5] x 2."""
    g = torch.Generator().manual_seed(seed)
    full = 3.0 * torch.randn(2, 5, v_pad, generator=g, dtype=torch.float64)
    # Padded entries get the largest logits: if padding leaked into the softmax it would dominate.
    full[..., vocab_size:] = 40.0
    labels = torch.randint(0, vocab_size, (2, 5), generator=g)
    labels[0, 1] = IGNORE  # ignore index: logp 0, no log-prob gradient
    labels[1, 4] = vocab_size - 1  # the last real token, next to the padding
    w_lp = torch.randn(2, 5, generator=g, dtype=torch.float64)
    w_h = torch.randn(2, 5, generator=g, dtype=torch.float64)
    return full.to(dtype), labels, w_lp, w_h


def _reference(full: torch.Tensor, labels, vocab_size: int, temperature: float, w_lp, w_h, use):
    """float64 reference values and the gradient w.r.t. the full padded logits [2, 5, v_pad]."""
    x = full.detach().to(torch.float64).requires_grad_(True)
    logp_all = torch.log_softmax(x[..., :vocab_size] / temperature, dim=-1)
    ok = labels >= 0
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * ok
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = 0.0
    if use in ("both", "logp"):
        loss = loss + (w_lp * logp).sum()
    if use in ("both", "entropy"):
        loss = loss + (w_h * ent).sum()
    loss.backward()
    return logp.detach(), ent.detach(), x.grad


def _run_case(rank: int, world: int, group, vocab_size: int, temperature: float,
              chunk: int | None, use: str, dtype=torch.float64) -> dict[str, float]:
    """Max abs errors of one configuration on this rank's shard (fp64 reference)."""
    v_pad = V_LOCAL * world
    full, labels, w_lp, w_h = _inputs(v_pad, vocab_size, dtype)
    shard = full[..., rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_(True)
    with_entropy = use != "logp"
    logp, ent = vocab_parallel_log_probs(
        shard, labels, tp_group=group, temperature=temperature, vocab_size=vocab_size,
        chunk_size=chunk, with_entropy=with_entropy,
    )
    loss = 0.0
    if use in ("both", "logp"):
        loss = loss + (w_lp.to(logp.dtype) * logp).sum()
    if use in ("both", "entropy"):
        loss = loss + (w_h.to(ent.dtype) * ent).sum()
    loss.backward()
    r_lp, r_h, r_grad = _reference(full, labels, vocab_size, temperature, w_lp, w_h, use)
    r_grad = r_grad[..., rank * V_LOCAL:(rank + 1) * V_LOCAL]
    out = {
        "logp": (logp.double() - r_lp).abs().max().item(),
        "grad": (shard.grad.double() - r_grad).abs().max().item(),
        "grad_scale": r_grad.abs().max().item(),
        "ignored_logp": logp[0, 1].abs().item(),
        "padded_grad": shard.grad.double()[..., max(0, vocab_size - rank * V_LOCAL):]
        .abs().sum().item(),
    }
    assert logp.shape == labels.shape and (ent is None) == (not with_entropy)
    if with_entropy:
        out["entropy"] = (ent.double() - r_h).abs().max().item()
    return out


# (vocab_size for TP=2 where V_pad=16, temperature, chunk, use). 8 and 5 leave rank 1 all padding.
_CASES = list(itertools.product((16, 13, 8), (1.0, 0.6), (None, 3), ("both",))) + [
    (13, 0.6, 1, "both"), (13, 0.6, 64, "both"), (13, 0.6, 4, "logp"), (13, 0.6, 4, "entropy"),
    (5, 1.3, 2, "both"),
]


def _assert_f64(errs: dict[str, float], case) -> None:
    for key in ("logp", "entropy", "grad", "ignored_logp", "padded_grad"):
        if key in errs:
            assert errs[key] <= F64_TOL, f"{case}: {key} error {errs[key]:.3e} > {F64_TOL}"


_ONE_RANK_VOCAB = {16: 8, 13: 6, 8: 7, 5: 1}  # V_pad = 8 on one rank; 1 = a single real token


@pytest.mark.parametrize("case", [(_ONE_RANK_VOCAB[v], t, c, u) for v, t, c, u in _CASES])
def test_single_rank_matches_reference_f64(case):
    vocab_size, temperature, chunk, use = case
    errs = _run_case(0, 1, None, vocab_size, temperature, chunk, use)
    _assert_f64(errs, case)


def _tp2_body(rank: int, world: int, cases) -> list[dict[str, float]]:
    # An explicit subgroup, as Megatron passes its TP group, rather than the default world group.
    group = dist.new_group(ranks=list(range(world)))
    results = [_run_case(rank, world, group, *case) for case in cases]
    results.append(_run_case(rank, world, group, 13, 0.6, 3, "both", dtype=torch.bfloat16))
    return results


@pytest.mark.slow
@pytest.mark.multirank
def test_tp2_matches_full_vocab_reference():
    per_rank = run_ranks(_tp2_body, world_size=2, args=(_CASES,), timeout_s=90)
    for rank, results in enumerate(per_rank):
        for case, errs in zip(_CASES, results[:-1]):
            _assert_f64(errs, (rank, *case))
        bf16 = results[-1]
        # bf16 inputs, fp32 compute: the reference uses the same bf16-rounded logits in fp64, so
        # only fp32 arithmetic (~1e-6) separates values; a bf16 computation would be off by ~1e-2.
        assert bf16["logp"] < 2e-5 and bf16["entropy"] < 2e-5, (rank, bf16)
        # The gradient is returned in bf16: unit roundoff 2^-8, relative to the largest entry.
        assert bf16["grad"] <= 2.0**-8 * bf16["grad_scale"], (rank, bf16)
        assert bf16["padded_grad"] == 0.0 and bf16["ignored_logp"] == 0.0


def test_bf16_input_vs_fp32_logits_reference():
    """bf16 logits (as a bf16 model emits) against the fp32-logit reference. The only error is
    the rounding of the logits, delta = (bf16(l) - l) / T, |delta| <= 2^-8 |l| / T. To first
    order |d logp| = |delta_label - sum p delta| <= 2 max|delta| and
    |d H| = |sum_v p_v (z_v - sum p z) delta_v| <= sum_v p_v |z_v - sum p z| max|delta|;
    10% slack for the second order and fp32 arithmetic."""
    full, labels, _, _ = _inputs(V_LOCAL, V_LOCAL, torch.float32)
    t = 0.8
    lp, ent = vocab_parallel_log_probs(full.bfloat16(), labels, temperature=t, with_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    z = full.double() / t
    ref = torch.log_softmax(z, dim=-1)
    r_lp = ref.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels >= 0)
    r_h = -(ref.exp() * ref).sum(-1)
    delta = ((full.bfloat16().double() - full.double()) / t).abs().amax(-1)  # [2, 5]
    assert delta.max() > 0  # the inputs really were rounded
    assert ((lp.double() - r_lp).abs() <= 1.1 * 2 * delta).all()
    p = ref.exp()
    spread = (p * (z - (p * z).sum(-1, keepdim=True)).abs()).sum(-1)
    assert ((ent.double() - r_h).abs() <= 1.1 * spread * delta).all()


def test_large_logits_are_stable_in_fp32():
    # Logits of 1e4: a naive exp overflows; max-subtraction keeps fp32 within 1e-3 of fp64 (the
    # inputs themselves carry fp32 rounding of ~1e-3 at this magnitude).
    g = torch.Generator().manual_seed(1)
    x = 1e4 + 5 * torch.randn(6, 50, generator=g)
    labels = torch.randint(0, 50, (6,), generator=g)
    lp, ent = vocab_parallel_log_probs(x, labels, with_entropy=True, chunk_size=4)
    ref = torch.log_softmax(x.double(), -1)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert (lp.double() - ref.gather(-1, labels[:, None]).squeeze(-1)).abs().max() < 1e-3
    assert (ent.double() + (ref.exp() * ref).sum(-1)).abs().max() < 1e-3


def test_gradcheck_single_rank():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 6, IGNORE, 3])

    def fn(t):
        lp, h = vocab_parallel_log_probs(t, labels, temperature=0.7, vocab_size=6, chunk_size=3,
                                         with_entropy=True)
        return lp, h

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-8)


def test_only_logits_and_token_vectors_are_saved_for_backward():
    """The memory bound: no [N, V] softmax is kept between forward and backward."""
    n, v = 12, 32
    x = torch.randn(n, v, requires_grad=True)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, h = vocab_parallel_log_probs(
            x, torch.randint(0, v, (n,)), chunk_size=5, with_entropy=True
        )
    big = [t for t in saved if t.numel() >= n * v]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr(), [t.shape for t in saved]
    assert all(t.numel() <= n for t in saved if t is not big[0])
    (lp.sum() + h.sum()).backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"labels": torch.zeros(3, dtype=torch.long)}, "labels must have the leading shape"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"vocab_size": 9}, r"vocab_size=9 must be in \[1, 8\]"),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
    ],
)
def test_user_errors_name_the_argument(kwargs, match):
    args = {"labels": torch.zeros(2, dtype=torch.long)}
    args.update(kwargs)
    labels = args.pop("labels")
    with pytest.raises(ValueError, match=match):
        vocab_parallel_log_probs(torch.randn(2, 8), labels, **args)
