"""The MoE actor: log-probs equal transformers', loss and gradients do not depend on the layout
(DP/EP/PP), the load-balancing loss is reported and reaches the router, and routing replay
(R3) makes the trainer's log-probs equal the engine's when the trainer's own routing would differ, on
padded and on packed rows (``use_remove_padding``: the EP2 and EP2 x PP2 layouts and one replay run; their
loss and gradients equal the padded DP4 layout's). Also: off-policy mini-batches under R3 and R2 (the second after an
optimizer step) run exactly the replayed experts (_two_mini_batches, _check_off_policy), and LoRA on a Qwen2-MoE
(dense layer 0, shared expert) at EP2 trains only its adapters and merges as peft does (_lora_moe, _check_lora).

Replay case: the "engine" model and the trainer's weights differ only in a near-tie of two experts'
router rows (engine: row3 = row2 + δ·r, trainer: row3 = row2 − δ·r, δ = 1e-6): every token where
those experts straddle the top-k boundary flips expert, as a kernel's rounding difference would
flip it between SGLang and Megatron. The engine's top-k ids come from the engine model's own router
logits (transformers, output_router_logits). One 4-rank gloo launch covers all of it.

Independent figures (computed here, in the test process, from transformers' router logits — no mrl code):

* log-probs: transformers on the left/right-padded batch with its attention_mask and position_ids
  (``reference_impl.hf_padded_log_probs``, no mrl input builder).
* ``moe/load_entropy``, ``moe/max_load_frac``, ``moe/layer<i>/max_load_frac``: the token set is the valid tokens in
  every layout — mrl passes Megatron the padding mask and its probes leave the masked positions out: the DP4
  padded layout's micro-batch (a rank's 2 samples) holds each sample's valid tokens from column 0, right-padded
  with token 0 to the longer one; the EP2 packed layout holds the valid tokens only; EP2 x PP2 packs 2 samples
  (sorted by length) per row and pads the shorter row of a rank with a sequence of its own of token 0 at
  position 0. Counting those paddings would move the shares by more than 1e-4 (checked from transformers' own
  routing of them, so the masking is what the equality tests). Each forward since the last update (old
  log-probs, the test's forward_backward, the update) runs the same set, so the shares are one pass's. Counts
  are exact: the shares agree to 1e-12, the entropy to 1e-8.
* ``moe/load_balancing_loss`` (aux run: EP2, DP4, padded micro-batches of 2 samples): per layer and micro-batch,
  transformers' ``load_balancing_loss_func`` (qwen3_moe) over the micro-batch's valid tokens (its
  ``attention_mask``: mrl passes Megatron's routers the padding mask, so padding is out of the aux loss), divided by top-k (transformers' token share is per top-k slot, Megatron's
  ``f_e = count_e / (T·k)``), averaged over layers and ranks; ``moe/aux_loss`` = 0.05 × that figure.
* gradients in scale and direction: each layout's update gradient, and the aux runs' (coefficients 0 and 0.05),
  equal transformers' autograd of the objective written out in tests/workers/moe_objective.py (policy term on
  transformers' log-probs, + the aux term above), per tensor within its derived float32 bound (4.8e-5 here).
* ``moe/replay_mismatch``: the engine's top-k sets (its router logits) against the trainer's own, from the
  trainer checkpoint's router rows applied to the router inputs of the engine's forward (replay makes the
  trainer's hidden states the engine's up to the δ in one softmax row), over the positions carrying engine
  ids (valid tokens but each sample's last), all layers: the exact count of flipped tokens (0.309 of them).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf
from tests.helpers.tiny_moe_checkpoints import make_tiny_moe_hf

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


def _rank(rank, world, path, engine_path, routed, ckpt, lora_path):
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
    out["offpolicy"] = {mode: _two_mini_batches(engine_path + "_trainer", batch, rb, mode, packed)
                        for mode, packed in (("rollout", True), ("old", False))}
    out["lora"] = _lora_moe(lora_path)
    return portable(out)


LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"]}


def _lora_moe(path):
    """LoRA on a Qwen2-MoE (layer 0 dense, layer 1 MoE with a shared expert) at EP2 (DP4): one update."""
    from mrl.config.actor import ActorConfig
    from mrl.megatron.lora import adapted_targets, export_peft_tensors
    from mrl.workers.actor import ActorWorker
    from mrl.workers.reference import ColocatedReference
    from tests.workers.batches import ragged_batch

    b = ragged_batch(vocab=96)
    cfg = ActorConfig(megatron={"expert_model_parallel_size": 2}, lora=LORA, ppo_micro_batch_size_per_gpu=2,
                      optim={"lr": 5e-2, "eps": 1e-2, "clip_grad": 1.0}, loss_agg_mode="token-mean")
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, seed=1234)
    ref = ColocatedReference(actor)
    before = {n: p.detach().clone() for c in actor.model.chunks for n, p in c.named_parameters()}
    r = {"lp0": actor.compute_log_prob(b)[0], "metrics": actor.update_policy(b)}
    after = {n: p for c in actor.model.chunks for n, p in c.named_parameters()}
    r["trainable"] = sorted(n for n, p in after.items() if p.requires_grad)
    r["changed"] = sorted(n for n, p in after.items() if not torch.equal(p, before[n]))
    del after
    r["lp1"], r["ref1"] = actor.compute_log_prob(b)[0], ref.compute_ref_log_prob(b)
    r["merged"] = {n: t.clone() for n, t in actor.export_hf_weights()}  # EP-gathered experts on every rank
    r["peft"] = dict(export_peft_tensors(actor.model.chunks))
    r["meta"] = {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha, "dropout": cfg.lora.dropout,
                 "targets": list(adapted_targets(cfg.lora.targets, actor.model.hf_config))}
    del actor, ref
    return r


def _mismatch(actor) -> list[float]:
    """[tokens whose own top-k differs from the replayed ids, tokens compared] summed over layers and ranks since
    the last call (the probes' moe/replay_mismatch counters)."""
    import torch.distributed as dist

    probes = actor.model.router_probes
    t = torch.stack([sum(p.mismatch for p in probes), sum(p.compared for p in probes)]).double()
    dist.all_reduce(t)
    for p in probes:
        p.reset()
    return t.tolist()


def _two_mini_batches(path, batch, rb, mode, packed):
    """Two mini-batches of 1 sample per rank (global samples r·2 + i in mini-batch i), the second after an optimizer
    step: each forward's routing as used (recorded), its log-probs and its own-vs-replayed mismatch count. R3
    replays ``rb``'s engine ids; R2 (``old``) records in compute_log_prob and replays through with_old_routing."""
    import dataclasses

    from mrl.workers.actor import ActorWorker, gather_log_probs

    actor = ActorWorker(_cfg(1, 1, 2, 1, 2, replay=mode), model_path=path, mini_batch_size_samples=4, seed=1234,
                        remove_padding=packed)
    r = {}
    src = rb
    if mode == "old":
        actor.model.remove_padding = not packed  # the record of the other row layout too (the update ignores it)
        actor.compute_log_prob(batch)
        r["recorded_other"] = actor.old_routing.routing.clone()
        actor.model.remove_padding = packed
        r["old_lp"], _ = actor.compute_log_prob(batch)
        r["recorded"] = actor.old_routing.routing.clone()
        src = actor.with_old_routing(batch)
        try:  # one update per recording
            actor.with_old_routing(batch)
            r["second_use"] = "no error"
        except RuntimeError as err:
            r["second_use"] = str(err)
        _mismatch(actor)  # the old-log-prob forward compared nothing (no ids yet): start the counts here
    local = actor.model.dp_shard(src)
    # on_policy only adds the forward's log-probs to the micro-batch outputs (and makes the ratio 1): the forward,
    # its replay and the optimizer step are the update's
    spec = dataclasses.replace(actor.loss_spec, on_policy=True)
    acc: dict = {}
    for i in range(2):
        mb = local.slice(i, i + 1)
        with actor.model.recording_routing() as rec:
            metrics, o, parts = actor._forward_backward(mb, spec)
        r[f"used{i}"] = actor.model.all_gather_dp(rec.local(parts))
        r[f"lp{i}"] = gather_log_probs(actor.model, o, parts, 1, mb.response_length)[0]
        r[f"mismatch{i}"] = _mismatch(actor)
        actor.optimizer_step(metrics, acc)
    del actor
    return r


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


def _in_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[..., E] router logits -> [..., E] bool, expert among the top-k of softmax (as both routers pick)."""
    idx = torch.softmax(logits.float(), -1).topk(k, dim=-1).indices
    return torch.zeros(logits.shape, dtype=torch.bool).scatter_(-1, idx, True)


def _compact_routing(model, batch):
    """Each sample's valid tokens from column 0, right-padded with token 0 to the longest sample, position ids
    = column index, no attention mask (causal only): Megatron's compact padded rows. Returns (sel [B, L, layers,
    E] bool: expert chosen, logits [B, L, layers, E], n [B] valid tokens)."""
    am = batch.attention_mask.bool()
    n = am.sum(-1)
    B, L = len(n), int(n.max())
    rows = torch.zeros(B, L, dtype=torch.long)
    for i in range(B):
        rows[i, : n[i]] = batch.input_ids[i][am[i]]
    with torch.no_grad():
        rl = model(input_ids=rows, output_router_logits=True).router_logits
    logits = torch.stack([x.reshape(B, L, -1) for x in rl], dim=2)
    return _in_topk(logits, model.config.num_experts_per_tok), logits, n


def _load_metrics(load: torch.Tensor) -> dict[str, float]:
    """[layers, E] assignment counts -> the moe/* load metrics as docs/moe.md defines them."""
    f = load / load.sum(-1, keepdim=True)
    ent = -torch.xlogy(f, f).sum(-1) / torch.log(torch.tensor(float(load.shape[-1]), dtype=torch.float64))
    out = {"moe/load_entropy": float(ent.mean()), "moe/max_load_frac": float(f.max(-1).values.mean())}
    out.update({f"moe/layer{i}/max_load_frac": float(f[i].max()) for i in range(load.shape[0])})
    return out


def _expected_loads(model, batch) -> list[dict[str, float]]:
    """The load metrics of each of LAYOUTS over the positions its routers run (module docstring)."""
    sel, _, n = _compact_routing(model, batch)
    sel = sel.double()
    L = sel.shape[1]
    col = torch.arange(L)[None, :]
    valid = (col < n[:, None]).double()  # [B, L]
    pair_max = n.reshape(-1, 2).max(-1).values.repeat_interleave(2)  # DP4, 2 samples per rank
    padded = (col < pair_max[:, None]).double()
    with torch.no_grad():  # a padding sequence of the packed rows: token 0 at position 0, attending to itself
        lone = _in_topk(torch.stack(model(input_ids=torch.zeros(1, 1, dtype=torch.long),
                                          output_router_logits=True).router_logits), model.config.num_experts_per_tok)
    pads = 0  # EP2 x PP2: DP2, 4 samples per rank, micro-batches of 2 sorted by length, rows padded to the longest
    for r in range(2):
        lens = sorted(n[4 * r: 4 * r + 4].tolist())
        rows = [lens[0] + lens[1], lens[2] + lens[3]]
        pads += sum(max(rows) - t for t in rows)
    count = lambda w: torch.einsum("bl,blke->ke", w, sel)
    # every layout counts the valid tokens only (padding masked); the other two figures are what the padded
    # and the EP2 x PP2 layouts would report if their padding counted (the check's power)
    return [_load_metrics(count(valid))] * 3 + [_load_metrics(count(padded)),
                                                _load_metrics(count(valid) + pads * lone[:, 0].double())]


def _expected_lb_loss(model, batch) -> float:
    """moe/load_balancing_loss of the aux run (EP2, DP4, one padded micro-batch of 2 samples per rank) from
    transformers' load_balancing_loss_func, per layer and micro-batch, / top-k (module docstring)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        load_balancing_loss_func,
    )

    _, logits, n = _compact_routing(model, batch)
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    vals = []
    for r in range(len(n) // 2):
        pair = n[2 * r: 2 * r + 2]
        mb = logits[2 * r: 2 * r + 2, : int(pair.max())]  # [2, pair max, layers, E]
        mask = (torch.arange(mb.shape[1]) < pair.unsqueeze(1)).long()  # the padding is out (Megatron's padding_mask)
        for layer in range(mb.shape[2]):
            vals.append(float(load_balancing_loss_func((mb[:, :, layer].reshape(-1, E),), E, k, attention_mask=mask)) / k)
    return sum(vals) / len(vals)


def test_moe_actor_layouts_aux_loss_and_routing_replay(tmp_path):
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_padded_log_probs

    path = make_tiny_hf(tmp_path / "qwen3_moe", "qwen3_moe")
    engine_path = tmp_path / "engine"
    shutil.copytree(path, engine_path)
    _near_tie(engine_path, +1.0)
    trainer_path = tmp_path / "engine_trainer"
    shutil.copytree(path, trainer_path)
    _near_tie(trainer_path, -1.0)

    batch = ragged_batch(vocab=300)
    engine = AutoModelForCausalLM.from_pretrained(str(engine_path), dtype=torch.float32).eval()
    gate_in = {}  # router inputs of the engine's forward, per layer
    hooks = [layer.mlp.gate.register_forward_pre_hook(
        lambda _m, args, i=i: gate_in.__setitem__(i, args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(engine.model.layers)]
    with torch.no_grad():
        engine_lp, _, out = hf_padded_log_probs(engine, batch, output_router_logits=True)
    for h in hooks:
        h.remove()
    B, S = batch.input_ids.shape
    k = engine.config.num_experts_per_tok
    routed = torch.stack([rl.reshape(B, S, -1).topk(k, dim=-1).indices for rl in out.router_logits], dim=2)
    # The engine never runs padding nor a response's last token: no ids there.
    last_col = (batch.attention_mask * torch.arange(S)).argmax(-1)
    routed[torch.arange(B), last_col] = -1
    routed[~batch.attention_mask.bool()] = -1
    # the flipped tokens, independently: the trainer's router rows on the engine's router inputs
    trainer_sd = load_file(str(trainer_path / "model.safetensors"))
    engine_sel = torch.stack([_in_topk(rl.reshape(B, S, -1), k) for rl in out.router_logits], dim=2)
    own_sel = torch.stack([_in_topk((gate_in[i] @ trainer_sd[f"model.layers.{i}.mlp.gate.weight"].T).reshape(B, S, -1), k)
                           for i in range(len(gate_in))], dim=2)
    has_ids = (routed[..., 0] >= 0)  # [B, S, layers]
    flipped = int(((own_sel != engine_sel).any(-1) & has_ids).sum())
    want_mismatch = flipped / int(has_ids.sum())

    lora_path = make_tiny_moe_hf(tmp_path / "qwen2_moe", "qwen2_moe")
    res = tensors(run_ranks(_rank, 4, args=(str(path), str(engine_path), routed.numpy(), str(tmp_path / "ckpt"),
                                            str(lora_path)), timeout_s=840))

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref_lp, _ = hf_padded_log_probs(model, batch)
    want_loads = _expected_loads(model, batch)
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
        for key, want in want_loads[li].items():  # exact counts, from transformers' router logits
            # (the entropy's 1/log E is a float32 constant in mrl: 2.7e-9 off; one count moved is > 1e-4)
            assert m[key] == pytest.approx(want, abs=1e-8 if key == "moe/load_entropy" else 1e-12), (lay, key, m[key], want)
        assert "moe/replay_mismatch" not in m  # no engine ids, nothing to compare
    # gradients in scale and direction: transformers' autograd of the same objective (tests/workers/moe_objective.py)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        load_balancing_loss_func,
    )

    from tests.workers.moe_objective import (
        grad_deviation,
        objective_grads,
        relative_bound,
    )

    bound = relative_bound(model.config)
    want = {c: objective_grads(model, batch, tmp_path / f"grads_{c}", aux_coef=c, lb_func=load_balancing_loss_func)
            for c in (0.0, 0.05)}
    checks = [(f"{lay}", {n: t for r in res for n, t in (r["layouts"][li]["grads"] or {}).items()}, 0.0,
               res[0]["layouts"][li]["loss"]) for li, lay in enumerate(LAYOUTS)]
    checks += [(f"aux {c}", {n: t for r in res for n, t in ((r["aux_grads"] or {}).get(c) or {}).items()}, c, None)
               for c in (0.0, 0.05)]
    for tag, grads, coef, loss in checks:
        d, worst = grad_deviation(grads, want[coef]["grads"])
        print(f"{tag}: grad vs transformers' autograd {d:.2e} ({worst}), bound {bound:.2e}")
        assert d <= bound, f"{tag}: gradient {worst} {d:.3g} (relative to its max) from transformers' autograd"
        if loss is not None:  # the forward_backward's loss (pg only: no entropy or KL term)
            assert abs(loss - want[0.0]["pg_loss"]) <= bound * want[0.0]["scale"], (tag, loss, want[0.0]["pg_loss"])
    # counting the padded layouts' padding would change the shares: the masking is what makes them agree
    assert all(abs(want_loads[0]["moe/load_entropy"] - w["moe/load_entropy"]) > 1e-4 for w in want_loads[3:]), want_loads
    # aux loss: transformers' load-balancing loss on the same micro-batches; changes only the router gradients
    m0, m1 = res[0]["aux_metrics_0.0"], res[0]["aux_metrics_0.05"]
    lb = _expected_lb_loss(model, batch)
    assert "moe/aux_loss" not in m0  # coef 0: Megatron computes none
    assert m1["moe/load_balancing_loss"] == pytest.approx(lb, rel=1e-6), (m1["moe/load_balancing_loss"], lb)
    assert m1["moe/aux_loss"] == pytest.approx(0.05 * lb, rel=1e-6)
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
    # the flipped tokens counted here: exactly the same ones
    assert mismatch == pytest.approx(want_mismatch, abs=1e-12), (mismatch, want_mismatch, flipped)
    _check_lora(res, lora_path, tmp_path / "peft")
    _check_off_policy(res, batch, routed, engine_lp, own_sel, engine_sel, AutoModelForCausalLM.from_pretrained(
        str(trainer_path), dtype=torch.float32).eval())
    print(f"replay: mismatch {mismatch:.3f} ({flipped} flips); max |Δlp| vs engine without/with replay "
          f"{float((res[0]['replay_none_lp'] - engine_lp).abs().max()):.2e} / "
          f"{float((res[0]['replay_rollout_lp'] - engine_lp).abs().max()):.2e}; loads {want_loads}; lb {lb:.6f}")


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., K] ids -> [...] bool: the same set of experts."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def _check_off_policy(res, batch, routed, engine_lp, own_sel, engine_sel, trainer) -> None:
    """Mini-batch 0 runs the weights the ids were chosen under, mini-batch 1 runs after an optimizer step (module
    docstring of the two runs: _two_mini_batches)."""
    routed = torch.as_tensor(routed)
    k = routed.shape[-1]
    am = batch.attention_mask.bool()
    with torch.no_grad():  # the trainer checkpoint's own routing, from transformers
        rl = trainer(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                     output_router_logits=True).router_logits
    B, S = am.shape
    own_hf = torch.stack([x.reshape(B, S, -1).topk(k, dim=-1).indices for x in rl], dim=2)  # [B, S, layers, K]
    top = torch.stack([torch.softmax(x.reshape(B, S, -1), -1).topk(k + 1, dim=-1).values for x in rl], dim=2)
    margin = top[..., k - 1] - top[..., k]  # [B, S, layers]: how far the k-th expert is from the next one
    flips = ((own_sel != engine_sel).any(-1) & (routed[..., 0] >= 0)).sum((1, 2))  # [B] near-tie flips per sample
    for r in res:
        for mode in ("rollout", "old"):
            o = r["offpolicy"][mode]
            ref = routed if mode == "rollout" else o["recorded"]
            has = ref[..., 0] >= 0  # [B, S, layers]
            for i in range(2):
                idx = torch.arange(i, B, 2)
                used = o[f"used{i}"]
                # replay applied: every position with ids routed to exactly those experts in the update's forward
                assert bool(_same_sets(used, ref[idx])[has[idx]].all()), (mode, i)
                # and the tokens without ids still routed (the trainer's own choice), padding did not
                assert bool((used[..., 0] >= 0)[am[idx]].all()) and bool((used[..., 0] < 0)[~am[idx]].all()), (mode, i)
        r3, r2 = r["offpolicy"]["rollout"], r["offpolicy"]["old"]
        idx0 = torch.arange(0, B, 2)
        # R3, first mini-batch: the engine's log-probs although 7 of its samples' routings are flipped near-ties
        assert float((r3["lp0"] - engine_lp[idx0]).abs().max()) <= 1e-5
        assert r3["mismatch0"][0] == float(flips[idx0].sum()) > 0, (r3["mismatch0"], flips)
        # R3, second mini-batch, after a step: its own routing still differs from the engine's, and not on the
        # near-tie tokens alone any more (the step moved it), while it ran the engine's experts (asserted above)
        assert 0 < r3["mismatch1"][0] != float(flips[1::2].sum()), (r3["mismatch1"], flips)
        # R2: the record is the old policy's own routing (transformers' top-k of the same weights) at every token
        # (up to float order: the trainer's rows hold a 1e-6 near-tie of experts 2 and 3, which Megatron's and
        # transformers' kernels may order differently; any difference must be such a tie, k-th vs (k+1)-th prob)
        for rec in (r2["recorded"], r2["recorded_other"]):  # padded rows (2 samples a row), packed rows
            differ = ~_same_sets(rec, own_hf) & am[..., None]
            assert int(differ.sum()) <= 2 and bool((margin[differ] < 1e-5).all()), (int(differ.sum()), margin[differ])
            assert bool((rec[~am] == -1).all())
        assert "routing_replay=old" in r2["second_use"]
        # first mini-batch: the old policy's routing and weights, so log pi_old itself
        assert float((r2["lp0"] - r2["old_lp"][idx0]).abs().max()) <= 1e-6
        assert r2["mismatch0"][0] == 0 and r2["mismatch0"][1] == float(am[idx0].sum()) * own_hf.shape[2]
        # second mini-batch: the step moved the free routing of some tokens; they still ran the recorded experts
        assert r2["mismatch1"][0] > 0, r2["mismatch1"]
    o3, o2 = res[0]["offpolicy"]["rollout"], res[0]["offpolicy"]["old"]
    print(f"off-policy R3: own-vs-engine mismatch {o3['mismatch0']} (near-tie flips {int(flips[0::2].sum())}) then "
          f"{o3['mismatch1']} (flips {int(flips[1::2].sum())}); |lp0 - engine| "
          f"{float((o3['lp0'] - engine_lp[0::2]).abs().max()):.2e}. R2: mismatch {o2['mismatch0']} then "
          f"{o2['mismatch1']}; |lp0 - old| {float((o2['lp0'] - o2['old_lp'][0::2]).abs().max()):.2e}")


def _check_lora(res, path, peft_dir) -> None:
    """LoRA on the MoE model: only adapters train (attention both layers, layer 0's dense MLP, layer 1's shared
    expert; none on the routed experts or the router), the reference is the base model, and the merged export
    equals peft's own merge of the exported adapters onto the transformers base, tensor by tensor."""
    import math

    import peft
    from transformers import AutoModelForCausalLM

    from mrl.megatron.lora_io import write_peft
    from tests.workers.batches import ragged_batch
    from tests.workers.reference_impl import hf_padded_log_probs

    b = ragged_batch(vocab=96)
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    base_sd = {n: t.clone() for n, t in base.state_dict().items()}
    with torch.no_grad():
        lp_base, _ = hf_padded_log_probs(base, b)
    r = res[0]["lora"]
    m = r["metrics"]
    assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, m
    assert r["trainable"] and all("_lora." in n for n in r["trainable"]), r["trainable"]
    assert r["changed"] and set(r["changed"]) <= set(r["trainable"]), r["changed"]  # the base did not move
    homes = {n.split("_lora.")[0].split("layers.")[1] for n in r["trainable"]}
    assert homes == {"0.self_attention.linear_qkv", "0.self_attention.linear_proj", "0.mlp.linear_fc1",
                     "0.mlp.linear_fc2", "1.self_attention.linear_qkv", "1.self_attention.linear_proj",
                     "1.mlp.shared_experts.linear_fc1", "1.mlp.shared_experts.linear_fc2"}, homes
    for x in res:
        lo = x["lora"]
        assert float((lo["lp0"] - lp_base).abs().max()) <= 1e-5  # B = 0: the policy starts as the base model
        assert float((lo["ref1"] - lp_base).abs().max()) <= 1e-5  # the reference is the base model
        assert float((lo["lp1"] - lp_base).abs().max()) > 1e-3  # the update moved the policy
    write_peft(peft_dir, r["peft"], r["meta"], base_model=str(path))
    pm = peft.PeftModel.from_pretrained(base, str(peft_dir)).eval()
    with torch.no_grad():
        lp_peft, _ = hf_padded_log_probs(pm, b)
    merged_peft = pm.merge_and_unload().state_dict()
    merged = r["merged"]
    fused = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}  # transformers fuses the experts in memory
    gate_up, down = base_sd["model.layers.1.mlp.experts.gate_up_proj"], base_sd["model.layers.1.mlp.experts.down_proj"]
    half = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):  # the routed experts (one tensor each in the export): frozen, the base's
        x = f"model.layers.1.mlp.experts.{e}."
        assert torch.equal(merged[x + "gate_proj.weight"], gate_up[e, :half]), e
        assert torch.equal(merged[x + "up_proj.weight"], gate_up[e, half:]), e
        assert torch.equal(merged[x + "down_proj.weight"], down[e]), e
    diffs = {}
    for name, t in merged_peft.items():
        if any(name.endswith(f) for f in fused):
            continue
        diffs[name] = float((merged[name] - t).abs().max())
    changed = {n for n in diffs if not torch.equal(merged_peft[n], base_sd[n])}
    assert max(diffs.values()) <= 1e-6, max(diffs.items(), key=lambda kv: kv[1])
    want = {f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in ("self_attn.q_proj", "self_attn.k_proj",
                                                                    "self_attn.v_proj", "self_attn.o_proj")}
    want |= {f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    want |= {f"model.layers.1.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    assert changed == want, changed ^ want  # peft adapted exactly the projections mrl did
    d_lp = float((lp_peft - res[0]["lora"]["lp1"]).abs().max())
    assert d_lp <= 1e-5, d_lp
    print(f"lora on MoE: merged export vs peft merge max |Δ| {max(diffs.values()):.2e} over {len(diffs)} tensors "
          f"({len(changed)} adapted); peft model vs actor log-probs {d_lp:.2e}")
