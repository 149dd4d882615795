"""The MoE actor: log-probs equal transformers', loss and gradients do not depend on the layout
(DP/EP/PP), the load-balancing loss is reported and reaches the router, and routing replay
(R3) makes the trainer's log-probs equal the engine's when the trainer's own routing would differ, on
padded and on packed rows (``use_remove_padding``: the EP2 and EP2 x PP2 layouts and one replay run; their
loss and gradients equal the padded DP4 layout's).

Replay case: the "engine" model and the trainer's weights differ only in a near-tie of two experts'
router rows (engine: row3 = row2 + δ·r, trainer: row3 = row2 − δ·r, δ = 1e-6): every token where
those experts straddle the top-k boundary flips expert, as a kernel's rounding difference would
flip it between SGLang and Megatron. The engine's top-k ids come from the engine model's own router
logits (transformers, output_router_logits). One 4-rank gloo launch covers all of it.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(900)]

LAYOUTS = [  # (tp, pp, ep, etp, micro-batch size)
    (1, 1, 1, 1, 2),   # DP4
    (1, 1, 2, 1, 2),   # EP2 (DP4, experts split over pairs of ranks)
    (1, 2, 2, 1, 2),   # EP2 x PP2
]
PACKED = [False, True, True]  # per layout: packed rows (use_remove_padding, sdpa) or padded rows  # TP > 1 trains MoE layers only with sequence parallelism (Megatron), which needs TE/Apex norms: GPU only
# (forward parity at TP2 and TP2+EP2 is in tests/megatron/test_moe_parity.py)
DELTA = 1e-6


def _cfg(tp, pp, ep, etp, mbs, *, replay="none", aux=0.0, dist_opt=False):
    from mrl.config.actor import ActorConfig

    return ActorConfig(
        megatron={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                  "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp},
        moe={"routing_replay": replay, "aux_loss_coef": aux},
        ppo_micro_batch_size_per_gpu=mbs, use_distributed_optimizer=dist_opt,
        optim={"lr": 1e-3, "eps": 1e-2, "weight_decay": 0.0, "clip_grad": 0.0},
        loss_agg_mode="token-mean",
    )


def _rank(rank, world, path, engine_path, routed, ckpt):
    from megatron.core import parallel_state as ps

    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import portable, ragged_batch
    from tests.workers.test_layout_invariance import _grads_by_hf_name

    batch = ragged_batch(vocab=300)
    out = {"layouts": []}
    for lay, packed in zip(LAYOUTS, PACKED):
        actor = ActorWorker(_cfg(*lay), model_path=path, mini_batch_size_samples=8, seed=1234, remove_padding=packed)
        keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
        lp, _ = actor.compute_log_prob(batch)
        m = actor.forward_backward(actor.model.dp_shard(batch))
        grads = _grads_by_hf_name(actor)
        metrics = actor.update_policy(batch)
        weights = {n: t.clone() for n, t in actor.export_hf_weights()}
        out["layouts"].append({"lp": lp, "loss": m["loss"], "grads": grads if keep else None,
                               "weights": weights if keep else None, "metrics": metrics})
        del actor
    # The load-balancing loss: reported, coef x its value, and it moves the router.
    grads_aux = {}
    for aux in (0.0, 0.05):
        actor = ActorWorker(_cfg(1, 1, 2, 1, 2, aux=aux), model_path=path, mini_batch_size_samples=8, seed=1234)
        actor.forward_backward(actor.model.dp_shard(batch))
        grads_aux[aux] = _grads_by_hf_name(actor)
        out[f"aux_metrics_{aux}"] = actor.update_policy(batch)
        del actor
    out["aux_grads"] = grads_aux if ps.get_data_parallel_rank() == 0 else None
    # Resume at another expert layout: Adam state (DistributedOptimizer, experts in their own expert-DP
    # group) saved at EP2 x PP2 continues at EP1 (DP4) exactly as the uninterrupted run.
    b2 = ragged_batch(vocab=300, seed=1)
    actor = ActorWorker(_cfg(1, 2, 2, 1, 2, dist_opt=True), model_path=path, mini_batch_size_samples=8, seed=1234)
    actor.update_policy(batch)
    actor.save(ckpt)
    actor.update_policy(b2)
    straight = {n: t.clone() for n, t in actor.export_hf_weights()}
    del actor
    actor = ActorWorker(_cfg(1, 1, 1, 1, 2, dist_opt=True), model_path=path, mini_batch_size_samples=8, seed=1234)
    actor.load(ckpt)
    actor.update_policy(b2)
    resumed = dict(actor.export_hf_weights())
    out["resume_max_diff"] = max(float((resumed[n] - t).abs().max()) for n, t in straight.items())
    del actor
    actor = ActorWorker(_cfg(1, 1, 1, 1, 2, dist_opt=True), model_path=path, mini_batch_size_samples=8, seed=1234)
    actor.load(ckpt, load_optimizer=False)  # the test's power: without Adam's state the run lands elsewhere
    actor.update_policy(b2)
    out["weights_only_diff"] = max(float((dict(actor.export_hf_weights())[n] - t).abs().max())
                                   for n, t in straight.items())
    del actor
    # Routing replay against the engine's ids, trainer weights with the flipped near-tie.
    rb = batch.replace(routed_experts=torch.as_tensor(routed))
    for replay, packed in (("none", False), ("rollout", False), ("rollout_packed", True)):
        actor = ActorWorker(_cfg(1, 1, 2, 1, 2, replay=replay.split("_")[0]), model_path=engine_path + "_trainer",
                            mini_batch_size_samples=8, seed=1234, remove_padding=packed)
        lp, _ = actor.compute_log_prob(rb)
        out[f"replay_{replay}_lp"] = lp
        out[f"replay_{replay}_metrics"] = actor.update_policy(rb)
        del actor
    return portable(out)


def _near_tie(path, sign):
    """Rewrite the router rows of expert 3 as row2 + sign·δ·r in every layer of the checkpoint at ``path``."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(7)
    for name in sorted(sd):
        if name.endswith("mlp.gate.weight"):
            w = sd[name].clone()
            w[3] = w[2] + sign * DELTA * torch.randn(w.shape[1], generator=g)
            sd[name] = w
    save_file(sd, str(f), metadata={"format": "pt"})


def test_moe_actor_layouts_aux_loss_and_routing_replay(tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_log_probs

    path = make_tiny_hf(tmp_path / "qwen3_moe", "qwen3_moe")
    engine_path = tmp_path / "engine"
    shutil.copytree(path, engine_path)
    _near_tie(engine_path, +1.0)
    shutil.copytree(path, str(engine_path) + "_trainer")
    _near_tie(type(engine_path)(str(engine_path) + "_trainer"), -1.0)

    batch = ragged_batch(vocab=300)
    engine = AutoModelForCausalLM.from_pretrained(str(engine_path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=batch.position_ids, output_router_logits=True)
        engine_lp, _ = hf_log_probs(engine, batch)
    B, S = batch.input_ids.shape
    k = engine.config.num_experts_per_tok
    routed = torch.stack([rl.reshape(B, S, -1).topk(k, dim=-1).indices for rl in out.router_logits], dim=2)
    # The engine never runs a response's last token: no ids there.
    last_col = (batch.attention_mask * torch.arange(S)).argmax(-1)
    routed[torch.arange(B), last_col] = -1

    res = tensors(run_ranks(_rank, 4, args=(str(path), str(engine_path), routed.numpy(), str(tmp_path / "ckpt")),
                            timeout_s=840))

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref_lp, _ = hf_log_probs(model, batch)
    base = res[0]["layouts"][0]
    g0 = {n: t for r in res for n, t in (r["layouts"][0]["grads"] or {}).items()}
    w0 = {n: t for r in res for n, t in (r["layouts"][0]["weights"] or {}).items()}
    for li, lay in enumerate(LAYOUTS):
        for r in res:
            torch.testing.assert_close(r["layouts"][li]["lp"], ref_lp, rtol=0, atol=1e-5, msg=lambda m, lay=lay: f"{lay}: {m}")
            assert r["layouts"][li]["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-7), lay
        grads = {n: t for r in res for n, t in (r["layouts"][li]["grads"] or {}).items()}
        weights = {n: t for r in res for n, t in (r["layouts"][li]["weights"] or {}).items()}
        assert set(grads) == set(g0) and any(".experts.3." in n for n in grads)
        for name, g in g0.items():
            scale = float(g.abs().max())
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-5 * max(scale, 1e-12),
                                       msg=lambda m, n=name, lay=lay: f"{lay} {n}: {m}")
            torch.testing.assert_close(weights[name], w0[name], rtol=0, atol=1e-6)
        m = res[0]["layouts"][li]["metrics"]
        assert 0.0 < m["moe/load_entropy"] <= 1.0 and 0.25 <= m["moe/max_load_frac"] <= 1.0
        assert "moe/replay_mismatch" not in m  # no engine ids, nothing to compare
    # aux loss: reported as coef x load-balancing loss; changes only the router gradients
    m0, m1 = res[0]["aux_metrics_0.0"], res[0]["aux_metrics_0.05"]
    assert "moe/aux_loss" not in m0 and m1["moe/load_balancing_loss"] > 0.9  # coef 0: Megatron computes none  # Switch loss is >= 1 when tokens spread
    assert m1["moe/aux_loss"] == pytest.approx(0.05 * m1["moe/load_balancing_loss"], rel=1e-9)
    ga = {n: t for r in res for n, t in (r["aux_grads"] or {}).get(0.0, {}).items()}
    gb = {n: t for r in res for n, t in (r["aux_grads"] or {}).get(0.05, {}).items()}
    changed = {n for n in ga if not torch.equal(ga[n], gb[n])}
    # The router's input depends on everything before it, its output does not feed the last experts or the head.
    assert {n for n in ga if n.endswith("mlp.gate.weight")} <= changed
    assert not changed & ({"lm_head.weight", "model.norm.weight"} | {n for n in ga if ".layers.3.mlp.experts." in n})
    for r in res:  # resume at EP1 of a checkpoint saved at EP2 x PP2 (with Adam state) continues exactly
        assert r["resume_max_diff"] <= 1e-6 and r["weights_only_diff"] > 1e-4, (r["resume_max_diff"], r["weights_only_diff"])
    # routing replay: without it the trainer's flipped near-tie changes log-probs; with it they are the engine's
    for r in res:
        off = float((r["replay_none_lp"] - engine_lp).abs().max())
        on = float((r["replay_rollout_lp"] - engine_lp).abs().max())
        on_packed = float((r["replay_rollout_packed_lp"] - engine_lp).abs().max())
        assert off > 1e-3, f"the near-tie did not flip any expert (max |Δ| {off:.2e}): the test lost its power"
        assert on <= 1e-5, f"with routing replay the trainer's log-probs differ from the engine's by {on:.2e}"
        assert on_packed <= 1e-5, f"packed rows with routing replay: {on_packed:.2e} from the engine's log-probs"
    assert res[0]["replay_none_metrics"].get("moe/replay_mismatch") is None
    mismatch = res[0]["replay_rollout_metrics"]["moe/replay_mismatch"]
    # packed rows hold the same tokens: the same routed tokens compared, the same mismatches
    assert res[0]["replay_rollout_packed_metrics"]["moe/replay_mismatch"] == pytest.approx(mismatch, abs=1e-12)
    assert res[0]["replay_rollout_packed_metrics"]["perf/pad_fraction"] == 0.0
    assert 0.05 < mismatch < 0.9, mismatch
    print(f"replay: mismatch {mismatch:.3f}; max |Δlp| vs engine without/with replay "
          f"{float((res[0]['replay_none_lp'] - engine_lp).abs().max()):.2e} / "
          f"{float((res[0]['replay_rollout_lp'] - engine_lp).abs().max()):.2e}")
