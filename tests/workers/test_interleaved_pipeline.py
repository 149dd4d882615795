"""Interleaved pipeline stages (``virtual_pipeline_model_parallel_size``, VPP) through the actor: PP2 x VPP2, alone
and under context parallelism (CP2), gives the log-probs, loss and gradients of transformers' model on the full batch
(tests/workers/reference_impl.py; fp32, 1e-5 as tests/workers/test_layout_invariance.py).

PP2 is the case that broke: with two stages the previous and next stage are the same rank, and Megatron core's
batched p2p posted the gradient and the activation headed there in the opposite order to the peer's receives, so
from the third micro-batch on the last stage computed its loss from the wrong tensor (0.3895 instead of 0.3898 on
this batch), or the ranks hung. Three splits, each a different path of the schedule: four micro-batches per rank
(the steady state, where the swap happened), three (not a multiple of PP: the group size of Megatron's schedule must
follow the count), one micro-batch holding the whole mini-batch (split to PP of them)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]

TEMPERATURE = 0.7
LAYOUTS = [  # (CP, micro-batch size, packed rows) at PP2 x VPP2 on 4 ranks, and the micro-batches each rank runs
    (1, 1, False),  # DP2, 4 samples per rank: 4 (the steady state)
    (2, 3, True),  # DP1: 3, not a multiple of PP
    (2, 8, True),  # DP1: 1, split to PP
]
N_MICRO = [4, 3, 2]


def _spec():
    from mrl.config.actor import ActorConfig
    from mrl.workers.loss import ActorLossSpec

    base = ActorLossSpec.from_config(ActorConfig(loss_agg_mode="token-mean", clip_ratio_c=3.0), TEMPERATURE,
                                     max_response_length=16)
    return dataclasses.replace(base, entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.1,
                               kl_loss_type="low_var_kl")


def _rank(rank, world, path):
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import portable, ragged_batch

    batch = ragged_batch()
    out = []
    for cp, mbs, packed in LAYOUTS:
        cfg = ActorConfig(megatron={"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                                    "context_parallel_size": cp, "attention_backend": "sdpa"},
                          use_remove_padding=packed, ppo_micro_batch_size_per_gpu=mbs, use_distributed_optimizer=False)
        actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, temperature=TEMPERATURE,
                            max_response_length=16, seed=1)
        actor.loss_spec = _spec()
        lp, _ = actor.compute_log_prob(batch)
        m, _, parts = actor._forward_backward(actor.model.dp_shard(batch), actor.loss_spec)
        params = [p for c in actor.model.chunks for p in c.parameters()]
        saved = [p.data for p in params]
        try:  # main_grad under HF names: this stage's two chunks
            for p in params:
                p.data = p.main_grad
            grads = {n: t.clone() for n, t in actor.export_hf_weights()}
        finally:
            for p, d in zip(params, saved):
                p.data = d
        out.append({"lp": lp, "loss": m["loss"], "n_micro": len(parts), "grads": grads})
        del actor
    return portable(out)


def test_pp2_vpp2_equals_transformers_on_the_full_batch(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_log_probs, hf_loss_and_grads

    path = make_tiny_hf(tmp_path / "qwen2", "qwen2", num_hidden_layers=4)  # one layer per virtual stage
    res = tensors(run_ranks(_rank, 4, args=(str(path),), timeout_s=540))
    batch = ragged_batch()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref_lp, _ = hf_log_probs(model, batch, TEMPERATURE)
    ref_loss, ref_grads = hf_loss_and_grads(model, batch, _spec())
    for li, layout in enumerate(LAYOUTS):
        assert [r[li]["n_micro"] for r in res] == [N_MICRO[li]] * 4, layout
        grads: dict[str, torch.Tensor] = {}
        for r in res:  # fp32, a 4-layer model: the bounds of tests/workers/test_layout_invariance.py
            torch.testing.assert_close(r[li]["lp"], ref_lp, rtol=0, atol=1e-5)
            assert r[li]["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), layout
            grads.update(r[li]["grads"])
        assert set(grads) == set(ref_grads), layout
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                       msg=lambda m, n=name, lay=layout: f"{lay} {n}: {m}")
