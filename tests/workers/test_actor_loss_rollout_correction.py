"""Rollout-correction weights in the worker's ``actor_loss_func`` (single process, tiny HF model in
float64, the helpers of test_norm_constant.py): they multiply the policy loss (weights 2 double it,
here with CISPO built from the actor config) and the loss stays micro-batch invariant with them."""
from __future__ import annotations

import pytest
import torch

from mrl.config.actor import ActorConfig
from mrl.workers.loss import ActorLossSpec, actor_loss_func
from tests.helpers.tiny_models import make_tiny_hf
from tests.workers import test_norm_constant as nc
from tests.workers.batches import ragged_batch


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf(tmp_path_factory.mktemp("qwen2"), "qwen2")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)


def test_weights_multiply_the_policy_loss_and_keep_micro_batch_invariance(hf_model):
    batch = ragged_batch()
    mask = batch.response_mask.to(torch.float64)
    spec = ActorLossSpec.from_config(ActorConfig(policy_loss="cispo"), nc.TEMPERATURE,
                                     max_response_length=nc.MAX_RESPONSE_LENGTH)
    vocab = int(hf_model.config.vocab_size)

    def loss_fn(mb, logits, n_tok, n_seq):
        return actor_loss_func(mb, logits, spec=spec, n_tok=n_tok, n_seq=n_seq, scale=1.0, tp_group=None,
                               vocab_size=vocab, chunk_size=None)[0]

    def one(b):
        return nc._micro_batches(b, [list(range(b.batch_size))], trim=False)

    plain = nc._run(hf_model, one(batch), loss_fn)
    doubled = nc._run(hf_model, one(batch.replace(rollout_is_weights=2 * mask)), loss_fn)
    assert plain[0] != 0 and doubled[0] == pytest.approx(2 * plain[0], rel=1e-12)
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2 * mask
    weighted = batch.replace(rollout_is_weights=w)
    want = nc._run(hf_model, one(weighted), loss_fn)
    assert want[0] != pytest.approx(plain[0], rel=1e-3)
    nc._assert_same(nc._run(hf_model, nc._dynamic_split(weighted), loss_fn), want)
