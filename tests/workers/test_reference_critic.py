"""Reference (colocated and separate), KL-loss gating, critic, offload round trip, embeddings.

One 2-rank launch: actor at TP1×PP2 with a colocated reference, then a separate reference at
TP2, then a critic at TP2.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

# Generous ceilings: a shared 2-core CI box runs these in 1-2 minutes each when idle.
pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(900)]


def _state(actor_like) -> list[torch.Tensor]:
    from mrl.workers.offload import _tensors

    return [t.detach().clone() for t in _tensors(actor_like.model, actor_like.optimizer)]


def _rank(rank, world, path):
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps a hung rank
    from mrl.config.actor import ActorConfig
    from mrl.config.critic import CriticConfig
    from mrl.config.ref import RefConfig
    from mrl.workers.actor import ActorWorker
    from mrl.workers.critic import CriticWorker
    from mrl.workers.reference import ColocatedReference, ReferenceWorker
    from tests.workers.batches import ragged_batch

    out = {}
    batch = ragged_batch()
    cfg = ActorConfig(megatron={"pipeline_model_parallel_size": 2}, ppo_micro_batch_size_per_gpu=4,
                      optim={"lr": 1e-2, "clip_grad": 1.0}, use_kl_loss=False)
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=4, seed=1234)
    colo = ColocatedReference(actor)
    out["embedding"] = actor.compute_response_embedding(batch)  # initial weights: compare with HF
    # use_kl_loss=False: a NaN ref_log_prob must not reach the loss
    poisoned = batch.replace(ref_log_prob=torch.full_like(batch.ref_log_prob, float("nan")))
    out["metrics_nokl"] = actor.update_policy(poisoned)
    lp_actor, _ = actor.compute_log_prob(batch)
    out["ref_colo"] = colo.compute_ref_log_prob(batch)
    lp_actor_after, _ = actor.compute_log_prob(batch)
    out["actor_lp_changed"] = float((lp_actor - out["ref_colo"]).abs().max())
    out["actor_unchanged_by_swap"] = bool(torch.equal(lp_actor, lp_actor_after))
    # use_kl_loss=True: the KL term is in the loss and reported
    actor.cfg = cfg.model_copy(update={"use_kl_loss": True, "kl_loss_coef": 0.5})
    from mrl.workers.loss import ActorLossSpec

    actor.loss_spec = ActorLossSpec.from_config(actor.cfg, 1.0, max_response_length=None)
    out["metrics_kl"] = actor.update_policy(batch.replace(ref_log_prob=out["ref_colo"]))
    # offload / onload round trip (forced on CPU) keeps every tensor bit-identical
    out["lp_before_offload"] = actor.compute_log_prob(batch)[0]
    before = _state(actor)
    actor.offload(force=True)
    freed = all(t.untyped_storage().nbytes() == 0 for t in actor.model.chunks[0].parameters())
    actor.onload()
    after = _state(actor)
    out["offload_freed"] = freed
    out["offload_equal"] = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    out["lp_after_onload"] = actor.compute_log_prob(batch)[0]
    del actor, colo

    ref = ReferenceWorker(RefConfig(placement="separate", megatron={"tensor_model_parallel_size": 2}),
                          model_path=path, micro_batch_size=3, seed=1234)
    out["ref_sep"] = ref.compute_ref_log_prob(batch)
    del ref

    ccfg = CriticConfig(megatron={"tensor_model_parallel_size": 2}, ppo_micro_batch_size_per_gpu=4,
                        optim={"lr": 1e-3, "clip_grad": 1.0, "weight_decay": 0.0}, cliprange_value=0.05)
    critic = CriticWorker(ccfg, model_path=path, mini_batch_size_samples=8, seed=1234)
    v0 = critic.compute_values(batch)
    target = torch.linspace(-1, 1, batch.response_length).expand_as(v0) * batch.response_mask
    losses, clip = [], []
    for i in range(6):
        v = critic.compute_values(batch)
        # first update: stale old values (V_old = V + 0.5) put V outside V_old ± 0.05, so the
        # clipped branch binds wherever the target lies below V + 0.225
        old = v + 0.5 * batch.response_mask if i == 0 else v
        m = critic.update_critic(batch.replace(values=old, returns=target))
        losses.append(m["critic/vf_loss"])
        clip.append(m["critic/vf_clipfrac"])
    out["critic_losses"], out["critic_clip"], out["critic_metrics"] = losses, clip, m
    out["v0"] = v0
    from tests.workers.batches import portable

    return portable(out)


def test_reference_kl_gating_critic_offload_embedding(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_log_probs

    path = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    res = tensors(run_ranks(_rank, 2, args=(str(path),), timeout_s=840))
    batch = ragged_batch()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref_lp, _ = hf_log_probs(model, batch)
        mi_hidden = _hf_response_embedding(model, batch)
    print("critic vf_loss per update:", res[0]["critic_losses"], "clipfrac:", res[0]["critic_clip"])
    for r in res:
        assert all(math.isfinite(v) for v in r["metrics_nokl"].values()), r["metrics_nokl"]
        assert "actor/kl_loss" not in r["metrics_nokl"] and r["metrics_nokl"]["actor/kl_coef"] == 0.0
        assert r["metrics_kl"]["actor/kl_loss"] > 0 and r["metrics_kl"]["actor/kl_coef"] == 0.5
        # the actor moved, the reference did not: colocated == separate == HF initial weights
        assert r["actor_lp_changed"] > 1e-3
        assert r["actor_unchanged_by_swap"]
        torch.testing.assert_close(r["ref_colo"], ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(r["ref_sep"], r["ref_colo"], rtol=0, atol=1e-5)
        assert r["offload_freed"] and r["offload_equal"]
        torch.testing.assert_close(r["lp_after_onload"], r["lp_before_offload"], rtol=0, atol=0)
        # critic: loss decreases on a fixed target, clipping engages, verl metric names
        ls = r["critic_losses"]
        # ls[0] used stale V_old (clipping on); from then on the loss falls monotonically
        assert all(b <= a for a, b in itertools.pairwise(ls[1:])) and ls[-1] < 0.1 * ls[1], ls
        assert r["critic_clip"][0] > 0.0
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"} <= set(r["critic_metrics"])
        assert r["v0"].shape == batch.response_mask.shape
        assert torch.all(r["v0"][batch.response_mask == 0] == 0)
        # mean final-norm hidden state over answer tokens == transformers' hidden_states[-1]
        torch.testing.assert_close(r["embedding"], mi_hidden, rtol=0, atol=1e-5)


def _hf_response_embedding(model, batch):
    from mrl.workers.minibatch import build_model_inputs

    mi = build_model_inputs(batch)
    am = (torch.arange(mi.tokens.shape[1])[None] < mi.num_tokens[:, None]).long()
    h = model(input_ids=mi.tokens, attention_mask=am, position_ids=mi.position_ids,
              output_hidden_states=True).hidden_states[-1]
    cols = (mi.resp_index + 1) * mi.resp_valid
    g = h.gather(1, cols[..., None].expand(-1, -1, h.shape[-1]))
    w = mi.resp_valid.float()
    return (g * w[..., None]).sum(1) / w.sum(1, keepdim=True)
