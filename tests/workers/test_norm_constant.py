"""Dr.GRPO's C in the worker losses: the trainer's C is rollout.max_response_length, not a width.

Single process, no Megatron: the worker's own ``actor_loss_func`` / ``critic_loss_func`` on logits
of a tiny HF model in float64. The ragged batch (R = 7) is cut by the dynamic (token-budget)
splitter, and every micro-batch is trimmed to its own longest response, so the micro-batches
have different padded widths. Summed (with the mini-batch's global N, S) they must give the loss
and gradient of one micro-batch padded to C = max_response_length = 12. Before C was passed the
worker divided each micro-batch by its own width and this failed. The multi-rank Megatron
counterpart is ``test_layout_invariance.py`` (wider-padded batch under every layout).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mrl.workers.actor import micro_batch_parts
from mrl.workers.loss import (
    ActorLossSpec,
    actor_loss_func,
    critic_loss_func,
    global_denominators,
)
from mrl.workers.megatron_model import MicroBatch
from mrl.workers.minibatch import build_model_inputs
from tests.helpers.tiny_models import make_tiny_hf
from tests.workers.batches import ragged_batch, with_response_width

MODE = "seq-mean-token-sum-norm"
MAX_RESPONSE_LENGTH = 12  # C; wider than the batch's R = 7, as in the trainer (R = longest response)
TEMPERATURE = 0.7
# Actor: float64 throughout; only the summation order and the attention's padded length differ.
RTOL = 1e-12
# Critic: ``response_values`` reads V in float32 by design, so float32 round-off.
RTOL_CRITIC = 1e-6


class _OneRank:
    """The two engine calls ``global_denominators`` makes, for a single rank (no DP)."""

    device = torch.device("cpu")

    def all_reduce_dp(self, t):
        return t


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf(tmp_path_factory.mktemp("qwen2"), "qwen2")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)


def _logits(model, mb: MicroBatch) -> torch.Tensor:
    mi = mb.inputs
    am = (torch.arange(mi.tokens.shape[1])[None] < mi.num_tokens[:, None]).long()
    return model(input_ids=mi.tokens, attention_mask=am, position_ids=mi.position_ids).logits


def _micro_batches(batch, parts, *, trim: bool) -> list[MicroBatch]:
    out = []
    for p in parts:
        sub = batch.index(p)
        if trim:  # this micro-batch's own padded width: its longest response
            sub = with_response_width(sub, int(sub.attention_mask[:, sub.prompt_length:].sum(-1).max()))
        out.append(MicroBatch(build_model_inputs(sub), sub))
    return out


def _dynamic_split(batch) -> list[MicroBatch]:
    parts = micro_batch_parts(batch, micro_batch_size=None, use_dynamic_bsz=True, max_tokens=24, dp_group=None)
    mbs = _micro_batches(batch, parts, trim=True)
    widths = [mb.data.response_length for mb in mbs]
    assert len(mbs) >= 3 and len(set(widths)) > 1, widths  # really different padded widths
    return mbs


def _run(model, mbs, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    n_tok, n_seq = global_denominators(mbs, _OneRank())
    total = sum(loss_fn(mb, _logits(model, mb), n_tok, n_seq) for mb in mbs)
    total.backward()
    return float(total.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}


def _assert_same(got, want, rtol=RTOL):
    loss, grads = got
    ref_loss, ref_grads = want
    assert loss == pytest.approx(ref_loss, rel=rtol, abs=0)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=rtol, atol=rtol * float(g.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("terms", ["pg", "pg+ent+kl"])
def test_actor_loss_dynamic_micro_batches_of_different_widths_equal_one_micro_batch(model, terms):
    batch = ragged_batch()
    from mrl.config.actor import ActorConfig

    spec = ActorLossSpec.from_config(ActorConfig(loss_agg_mode=MODE), TEMPERATURE, max_response_length=MAX_RESPONSE_LENGTH)
    if terms == "pg+ent+kl":
        spec = dataclasses.replace(spec, entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.1)
    vocab = int(model.config.vocab_size)

    def loss_fn(mb, logits, n_tok, n_seq):
        return actor_loss_func(mb, logits, spec=spec, n_tok=n_tok, n_seq=n_seq, scale=1.0, tp_group=None,
                               vocab_size=vocab, chunk_size=None)[0]

    one = _micro_batches(with_response_width(batch, MAX_RESPONSE_LENGTH), [list(range(batch.batch_size))],
                         trim=False)
    want = _run(model, one, loss_fn)
    assert want[0] != 0.0
    _assert_same(_run(model, _dynamic_split(batch), loss_fn), want)
    # and the batch as the trainer pads it (R = 7 < C) in one micro-batch
    _assert_same(_run(model, _micro_batches(batch, [list(range(batch.batch_size))], trim=False), loss_fn), want)


def test_critic_loss_dynamic_micro_batches_of_different_widths_equal_one_micro_batch(model):
    batch = ragged_batch()
    g = torch.Generator().manual_seed(3)
    batch = batch.replace(values=torch.randn(batch.response_mask.shape, generator=g, dtype=torch.float64),
                          returns=torch.randn(batch.response_mask.shape, generator=g, dtype=torch.float64))

    def loss_fn(mb, logits, n_tok, n_seq):  # any differentiable [b, L, 1] head stands in for V
        return critic_loss_func(mb, logits[..., :1], cliprange_value=0.2, loss_agg_mode=MODE, n_tok=n_tok,
                                n_seq=n_seq, scale=1.0, norm_constant=MAX_RESPONSE_LENGTH)[0]

    one = _micro_batches(with_response_width(batch, MAX_RESPONSE_LENGTH), [list(range(batch.batch_size))],
                         trim=False)
    want = _run(model, one, loss_fn)
    assert want[0] != 0.0
    _assert_same(_run(model, _dynamic_split(batch), loss_fn), want, rtol=RTOL_CRITIC)


def test_sum_norm_without_max_response_length_is_refused_not_defaulted_to_the_width():
    from mrl.config.actor import ActorConfig

    cfg = ActorConfig(loss_agg_mode=MODE)
    with pytest.raises(ValueError, match="rollout.max_response_length"):
        ActorLossSpec.from_config(cfg, 1.0, max_response_length=None)
    with pytest.raises(ValueError, match="must be > 0"):
        ActorLossSpec.from_config(cfg, 1.0, max_response_length=0)
    assert ActorLossSpec.from_config(cfg, 1.0, max_response_length=512).norm_constant == 512
    with pytest.raises(ValueError, match="actor.loss_agg_mode=seq-mean-token-sum-norm"):
        ActorLossSpec.from_config(cfg, 1.0, max_response_length=None)
    # the other modes do not use C and do not need it
    ActorLossSpec.from_config(ActorConfig(loss_agg_mode="token-mean"), 1.0, max_response_length=None)
