"""Actor save at TP2×PP2 (DistributedOptimizer, DP1) → load at TP1×PP2 (DP2) and TP1×PP1 (DP4).

Both loads give the saved policy's log-probs, LR schedule and Adam moments: the next optimizer
step equals the uninterrupted run's. ``export_hf`` output loads in transformers and reproduces the
worker's log-probs.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

# Generous ceilings: a shared 2-core CI box runs these in 1-2 minutes each when idle.
pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(900)]


def _cfg(tp, pp):
    from mrl.config.actor import ActorConfig

    return ActorConfig(
        megatron={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        ppo_micro_batch_size_per_gpu=2, use_distributed_optimizer=True,
        # eps=1e-2: Adam's step is smooth in g (see test_layout_invariance), warmup+cosine schedule
        optim={"lr": 1e-3, "eps": 1e-2, "lr_warmup_steps": 1, "lr_schedule": "cosine", "clip_grad": 1.0},
    )


def _rank(rank, world, path, ckpt, hf_out):
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps a hung rank
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import ragged_batch

    a_batch, b_batch = ragged_batch(seed=1), ragged_batch(seed=2)
    out = {}
    actor = ActorWorker(_cfg(2, 2), model_path=path, mini_batch_size_samples=8, total_optimizer_steps=4, seed=1234)
    actor.update_policy(a_batch)
    out["lp1"] = actor.compute_log_prob(b_batch)[0]
    actor.save(ckpt)
    out["m2"] = actor.update_policy(b_batch)
    out["lp2"] = actor.compute_log_prob(b_batch)[0]
    del actor

    # resharded over TP, PP and DP: TP1×PP2 (DP2) resumes the optimizer exactly
    resumed = ActorWorker(_cfg(1, 2), model_path=path, mini_batch_size_samples=8, total_optimizer_steps=4, seed=1234)
    resumed.load(ckpt)
    out["lp1_loaded_pp2"] = resumed.compute_log_prob(b_batch)[0]
    out["step_loaded"] = resumed.global_step
    out["m2_resumed"] = resumed.update_policy(b_batch)
    out["lp2_resumed"] = resumed.compute_log_prob(b_batch)[0]
    del resumed

    # TP1×PP1 (DP4)
    flat = ActorWorker(_cfg(1, 1), model_path=path, mini_batch_size_samples=8, total_optimizer_steps=4, seed=1234)
    flat.load(ckpt)
    out["lp1_loaded_flat"] = flat.compute_log_prob(b_batch)[0]
    out["m2_flat"] = flat.update_policy(b_batch)
    out["lp2_flat"] = flat.compute_log_prob(b_batch)[0]
    flat.export_hf(hf_out)
    from tests.workers.batches import portable

    return portable(out)


def test_save_tp2pp2_load_tp1pp1_resumes_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_log_probs

    path = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    res = tensors(run_ranks(_rank, 4, args=(str(path), str(tmp_path / "ckpt"), str(tmp_path / "hf")), timeout_s=840))
    for r in res:
        assert r["step_loaded"] == 1
        torch.testing.assert_close(r["lp1_loaded_pp2"], r["lp1"], rtol=0, atol=1e-5)
        torch.testing.assert_close(r["lp1_loaded_flat"], r["lp1"], rtol=0, atol=1e-5)
        # Adam moments and the LR schedule resumed: the second step matches the uninterrupted one
        for m in (r["m2_resumed"], r["m2_flat"]):
            assert m["actor/lr"] == pytest.approx(r["m2"]["actor/lr"], rel=1e-12)
            assert m["actor/grad_norm"] == pytest.approx(r["m2"]["actor/grad_norm"], rel=1e-5)
        torch.testing.assert_close(r["lp2_resumed"], r["lp2"], rtol=0, atol=1e-5)
        torch.testing.assert_close(r["lp2_flat"], r["lp2"], rtol=0, atol=1e-5)
        assert float((r["lp2"] - r["lp1"]).abs().max()) > 1e-4  # the step did move the policy
    print("max |d log-prob| of the step after loading vs uninterrupted: TP1xPP2",
          float((res[0]["lp2_resumed"] - res[0]["lp2"]).abs().max()), "TP1xPP1",
          float((res[0]["lp2_flat"] - res[0]["lp2"]).abs().max()))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with torch.no_grad():
        lp, _ = hf_log_probs(model, ragged_batch(seed=2))
    torch.testing.assert_close(lp, res[0]["lp2_flat"], rtol=0, atol=1e-5)
