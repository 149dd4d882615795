"""``ColocatedReference.compute_repr_similarity`` (algorithm.repr_align) on a real tiny Megatron GPTModel.

One gloo rank: gold == generated gives cosine 1, another answer does not, and the embeddings are
the reference's (initial) weights: an actor update changes neither the similarities nor, after
the swap, the actor's own weights.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TOL = 1e-6  # fp32 forward of the same tokens in two differently padded batches, cosine in fp64


def _gold_ids(batch, rows):
    P = batch.prompt_length
    return [batch.input_ids[r, P:][batch.attention_mask[r, P:].bool()].tolist() for r in rows]


def _rank(rank, world, path):
    from mrl.config.actor import ActorConfig
    from mrl.driver.shaping import build_gold_batch
    from mrl.workers.actor import ActorWorker
    from mrl.workers.reference import ColocatedReference
    from tests.workers.batches import portable, ragged_batch

    batch = ragged_batch()
    B = batch.batch_size
    same = build_gold_batch(batch, _gold_ids(batch, range(B)), pad_token_id=0)
    # another sample's answer after this prompt (row 0 answers with row 1's, ...)
    other = build_gold_batch(batch, _gold_ids(batch, [(i + 1) % B for i in range(B)]), pad_token_id=0)
    actor = ActorWorker(ActorConfig(ppo_micro_batch_size_per_gpu=3, optim={"lr": 1e-2, "clip_grad": 1.0},
                                    use_kl_loss=False), model_path=path, mini_batch_size_samples=8, seed=1234)
    ref = ColocatedReference(actor)
    out = {"self": ref.compute_repr_similarity(batch, same), "other": ref.compute_repr_similarity(batch, other)}
    actor.update_policy(batch)
    lp_before = actor.compute_log_prob(batch)[0]
    out["other_after_update"] = ref.compute_repr_similarity(batch, other)
    out["actor_restored"] = bool(torch.equal(lp_before, actor.compute_log_prob(batch)[0]))
    actor_emb = actor.compute_response_embedding(batch)
    gen_emb = actor.compute_response_embedding(other)
    out["actor_other"] = torch.nn.functional.cosine_similarity(actor_emb.double(), gen_emb.double(), dim=-1)
    return portable(out)


def test_similarity_with_itself_is_one_and_uses_reference_weights(tmp_path) -> None:
    from tests.workers.batches import tensors

    path = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    r = tensors(run_ranks(_rank, 1, args=(str(path),), timeout_s=280))[0]
    print("self:", r["self"].tolist(), "other:", r["other"].tolist())
    assert r["self"].shape == (8,)
    torch.testing.assert_close(r["self"], torch.ones(8), rtol=0, atol=TOL)
    assert torch.all(r["other"] < 1 - 1e-3), r["other"]
    # the reference did not move with the actor; the actor's own embeddings did
    torch.testing.assert_close(r["other_after_update"], r["other"], rtol=0, atol=TOL)
    assert (r["actor_other"].float() - r["other"]).abs().max() > 1e-4
    assert r["actor_restored"]
