"""actor.on_policy_shortcut is exact: the update's own detached log-probs in place of the
old-log-prob forward give the same loss terms and gradients (≤ 1e-7, fp32) and the same update.

One 2-rank launch (DP2, so the log-probs are gathered over DP like ``compute_log_prob``'s):

1. one worker, no optimizer step: ∇L with log π_old from ``compute_log_prob`` vs ∇L with
   log π_old = sg(log π_θ) of the same forward (``ActorLossSpec.on_policy``), grads read from
   Megatron's DDP buffers;
2. two fresh workers from the same weights: ``update_policy`` after ``compute_log_prob`` vs
   ``update_policy_on_policy``: same metrics, same log-probs/entropies handed back, same policy after;
3. the shortcut refuses a batch that would take more than one optimizer step.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(900)]

TOL = 1e-7  # fp32; the two paths run the same micro-batches through the same kernels
KEYS = ["loss", "pg_loss", "entropy", "kl_loss", "ppo_kl", "pg_clipfrac"]


def _grads(actor) -> torch.Tensor:
    return torch.cat([p.main_grad.detach().flatten().clone() for c in actor.model.chunks for p in c.parameters()
                      if p.requires_grad])


def _rank(rank, world, path):
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import portable, ragged_batch

    batch = ragged_batch(with_rollout=True).replace(old_log_probs=None)
    probe = ragged_batch(seed=3)
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=2, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
                      tis_imp_ratio_cap=2.0, optim={"lr": 1e-2, "clip_grad": 1.0})
    out = {}
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, seed=1234)
    lp, _ = actor.compute_log_prob(batch)
    local = actor.model.dp_shard(batch.replace(old_log_probs=lp))
    out["m_recomputed"] = actor.forward_backward(local)
    out["g_recomputed"] = _grads(actor)
    spec = dataclasses.replace(actor.loss_spec, on_policy=True)
    out["m_shortcut"] = actor._forward_backward(local.replace(old_log_probs=None), spec)[0]
    out["g_shortcut"] = _grads(actor)
    del actor

    a = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, seed=1234)
    out["lp"], out["ent"] = a.compute_log_prob(batch)
    out["u_recomputed"] = a.update_policy(batch.replace(old_log_probs=out["lp"]))
    out["after_recomputed"] = a.compute_log_prob(probe)[0]
    del a
    b = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, seed=1234)
    out["u_shortcut"], out["lp_shortcut"], out["ent_shortcut"] = b.update_policy_on_policy(batch)
    out["after_shortcut"] = b.compute_log_prob(probe)[0]
    out["changed"] = float((out["after_shortcut"] - b.compute_log_prob(probe)[0]).abs().max())  # sanity: deterministic
    try:
        b.update_policy_on_policy(ragged_batch(B=16).replace(old_log_probs=None))
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    return portable(out)


def test_on_policy_shortcut_is_exact(tmp_path):
    from tests.workers.batches import tensors

    path = make_tiny_hf(tmp_path / "m", "qwen2")
    res = tensors(run_ranks(_rank, 2, args=(str(path),), timeout_s=840))
    for r in res:
        for k in KEYS:
            assert abs(r["m_shortcut"][k] - r["m_recomputed"][k]) <= TOL, (k, r["m_shortcut"][k], r["m_recomputed"][k])
        g0, g1 = r["g_recomputed"], r["g_shortcut"]
        assert float(g0.abs().max()) > 1e-4  # a real gradient
        assert float((g0 - g1).abs().max()) <= TOL * max(1.0, float(g0.abs().max()))
        for k, v in r["u_recomputed"].items():
            assert abs(r["u_shortcut"][k] - v) <= 1e-6 * max(1.0, abs(v)), (k, r["u_shortcut"][k], v)
        assert float((r["lp_shortcut"] - r["lp"]).abs().max()) <= 1e-6
        assert float((r["ent_shortcut"] - r["ent"]).abs().max()) <= 1e-6
        assert float((r["after_shortcut"] - r["after_recomputed"]).abs().max()) <= 1e-6
        assert r["changed"] == 0.0
        assert "one optimizer step per batch" in r["refused"] and "actor.on_policy_shortcut=null" in r["refused"]
