"""The key correctness test: loss and DP-reduced gradient do not depend on the layout.

One fixed ragged batch (8 samples, prompts 2..6 and responses 1..7 tokens, one masked response
token). Truth: the full-batch loss and gradient of the same loss on the HF model in one process
(``reference_impl``: TP1×PP1, one micro-batch). One 4-rank launch re-initialises Megatron for
each layout — TP1PP1 (DP4), TP2 (DP2), PP2 (DP2, 2 micro-batches/rank, 1F1B),
TP2PP2 (DP1, 4 micro-batches), PP2 with dynamic micro-batching — each with an attention backend and row
layout: packed rows (``use_remove_padding``, sdpa) at TP1, TP2 and PP2-dynamic, the padded rows on
sdpa at TP2PP2 and on Megatron's unfused ``local`` attention at PP2; activation recompute (full at TP2PP2
and PP2-dynamic, selective at TP2) must not change a value. Packed layouts also run the padded
rows on the same model (one spec) and compare log-probs, loss and gradients with them directly.
Each layout loops over the 4 loss_agg_modes × {plain
PG, PG − 0.05·H + 0.1·KL(k3)} plus ``kl_loss_coef=0``; ``seq-mean-token-sum-norm`` uses Dr.GRPO's
C = max_response_length = 16 (wider than R = 7) and is run once more on the same batch padded to
R = 11, which must not change loss or gradient. Then one optimizer step per layout.
Gradients are compared by HF name after TP gathering (``export_hf_weights`` on ``main_grad``).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

# Generous ceilings: a shared 2-core CI box runs these in 1-2 minutes each when idle.
pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(900)]

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LAYOUTS = [  # (tp, pp, micro_batch_size, dynamic max tokens)
    (1, 1, 2, None),
    (2, 1, 4, None),
    (1, 2, 2, None),
    (2, 2, 2, None),
    (1, 2, None, 24),
]
ROWS = [  # per layout: (attention backend, packed rows, activation recompute)
    ("sdpa", True, None),
    ("sdpa", True, "selective"),
    ("local", False, None),
    ("sdpa", False, "full"),
    ("sdpa", True, "full"),
]
PACKED_KEY = ("token-mean", "pg+ent+kl")  # the spec packed layouts also run on padded rows
TEMPERATURE = 0.7
MAX_RESPONSE_LENGTH = 16  # Dr.GRPO's C (rollout.max_response_length); the batch's R is 7
WIDE_R = 11  # the same batch with more response padding: C must not follow it
WIDE_KEY = ("seq-mean-token-sum-norm", "pg+ent+kl")


def _specs():
    from mrl.config.actor import ActorConfig
    from mrl.workers.loss import ActorLossSpec

    out = {}
    for mode in MODES:
        base = ActorLossSpec.from_config(ActorConfig(loss_agg_mode=mode, clip_ratio_c=3.0), TEMPERATURE,
                                         max_response_length=MAX_RESPONSE_LENGTH)
        out[(mode, "pg")] = base
        out[(mode, "pg+ent+kl")] = dataclasses.replace(
            base, entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    out[("token-mean", "kl0")] = dataclasses.replace(
        out[("token-mean", "pg")], use_kl_loss=True, kl_loss_coef=0.0)
    return out


def _grads_by_hf_name(actor) -> dict[str, torch.Tensor]:
    """TP-gathered ``main_grad`` under HF names, this pipeline stage (swap data <-> main_grad)."""
    params = [p for c in actor.model.chunks for p in c.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        return {n: t.clone() for n, t in actor.export_hf_weights()}
    finally:
        for p, d in zip(params, saved):
            p.data = d


def _rank(rank, world, path):
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps a hung rank
    from megatron.core import parallel_state as ps

    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from mrl.workers.loss import ActorLossSpec
    from tests.workers.batches import ragged_batch, with_response_width

    batch = ragged_batch()
    results = []
    for (tp, pp, mbs, max_tok), (backend, packed, recompute) in zip(LAYOUTS, ROWS):
        cfg = ActorConfig(
            megatron={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                      "attention_backend": backend},
            use_remove_padding=packed, recompute_granularity=recompute,
            ppo_micro_batch_size_per_gpu=mbs, use_dynamic_bsz=max_tok is not None,
            ppo_max_token_len_per_gpu=max_tok or 16384, use_distributed_optimizer=False,
            # eps=1e-2 makes Adam's first step lr*g/(|g|+eps): smooth in g, so weights after one
            # step are comparable across layouts at fp32 tolerance (eps=1e-8 gives lr*sign(g)).
            optim={"lr": 1e-3, "eps": 1e-2, "weight_decay": 0.0, "clip_grad": 0.0},
            use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.05, loss_agg_mode="token-mean",
        )
        actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, temperature=TEMPERATURE,
                            max_response_length=MAX_RESPONSE_LENGTH, seed=1234)
        e = actor.model
        keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
        lp, ent = actor.compute_log_prob(batch)
        local = e.dp_shard(batch)
        n_micro = None
        per_spec = {}
        for key, spec in _specs().items():
            actor.loss_spec = spec
            m = actor.forward_backward(local)
            grads = _grads_by_hf_name(actor)  # collective over TP: every rank takes part
            per_spec[key] = (m["loss"], grads if keep else None)
        actor.loss_spec = _specs()[WIDE_KEY]
        m = actor.forward_backward(e.dp_shard(with_response_width(batch, WIDE_R)))
        grads = _grads_by_hf_name(actor)
        per_spec["wide"] = (m["loss"], grads if keep else None)
        padded = None
        if packed:  # the same model on padded rows: the packed rows' direct baseline
            e.remove_padding = False
            p_lp, p_ent = actor.compute_log_prob(batch)
            actor.loss_spec = _specs()[PACKED_KEY]
            m = actor.forward_backward(local)
            grads = _grads_by_hf_name(actor)  # collective over TP: every rank takes part
            padded = (p_lp, p_ent, m["loss"], grads if keep else None)
            e.remove_padding = True
        # micro-batches this rank ran (from the split the worker uses)
        from mrl.workers.actor import micro_batch_parts

        n_micro = len(micro_batch_parts(local, micro_batch_size=mbs, use_dynamic_bsz=max_tok is not None,
                                        max_tokens=max_tok or 0, dp_group=e.dp_group))
        actor.loss_spec = ActorLossSpec.from_config(cfg, TEMPERATURE, max_response_length=MAX_RESPONSE_LENGTH)
        metrics = actor.update_policy(batch)
        weights = {n: t.clone() for n, t in actor.export_hf_weights()}
        weights = weights if keep else None
        results.append({"layout": (tp, pp, mbs, max_tok), "dp": e.dp_size, "n_micro": n_micro, "lp": lp, "ent": ent,
                        "per_spec": per_spec, "metrics": metrics, "weights": weights, "padded": padded,
                        "backend": e.attention_backend, "recompute": e.config.recompute_granularity})
        del actor
    from tests.workers.batches import portable

    return portable(results)


def _merge(rank_results, layout_idx, getter):
    out = {}
    for res in rank_results:
        part = getter(res[layout_idx])
        if part:
            out.update(part)
    return out


def test_loss_and_grads_equal_full_batch_reference_under_every_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_log_probs, hf_loss_and_grads

    path = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    res = tensors(run_ranks(_rank, 4, args=(str(path),), timeout_s=840))

    batch = ragged_batch()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs(model, batch, TEMPERATURE)
    truth = {key: hf_loss_and_grads(model, batch, spec) for key, spec in _specs().items()}

    worst = {"lp": 0.0, "loss": 0.0, "grad": 0.0, "weights": 0.0}
    for li, layout in enumerate(LAYOUTS):
        assert res[0][li]["layout"] == layout
        pp = layout[1]
        if pp == 2:  # at least two micro-batches per rank so 1F1B really pipelines
            assert res[0][li]["n_micro"] >= 2, layout
        assert (res[0][li]["backend"], res[0][li]["recompute"]) == (ROWS[li][0], ROWS[li][2])
        if ROWS[li][1]:  # packed rows == padded rows of the same model (fp32, 1e-5)
            for r in res:
                p_lp, p_ent, p_loss, _ = r[li]["padded"]
                torch.testing.assert_close(r[li]["lp"], p_lp, rtol=0, atol=1e-5)
                torch.testing.assert_close(r[li]["ent"], p_ent, rtol=0, atol=1e-5)
                assert r[li]["per_spec"][PACKED_KEY][0] == pytest.approx(p_loss, rel=1e-5, abs=1e-7), layout
            g_pad = _merge(res, li, lambda x: x["padded"][3])
            g_pack = _merge(res, li, lambda x: x["per_spec"][PACKED_KEY][1])
            assert set(g_pad) == set(g_pack)
            for name, g in g_pad.items():
                torch.testing.assert_close(g_pack[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                           msg=lambda m, n=name, lay=layout: f"packed vs padded {lay} {n}: {m}")
            # packed: no padding but, with PP, the columns that give every micro-batch one length
            assert res[0][li]["metrics"]["perf/pad_fraction"] == 0.0 if pp == 1 else \
                res[0][li]["metrics"]["perf/pad_fraction"] < 0.1
        else:
            assert res[0][li]["metrics"]["perf/pad_fraction"] > 0.2  # this ragged batch, right-padded
        for r in res:  # identical on every rank, caller's order, equal to transformers
            torch.testing.assert_close(r[li]["lp"], ref_lp, rtol=0, atol=1e-5)
            torch.testing.assert_close(r[li]["ent"], ref_ent, rtol=0, atol=1e-5)
            worst["lp"] = max(worst["lp"], float((r[li]["lp"] - ref_lp).abs().max()))
        for key, (ref_loss, ref_grads) in [*truth.items(), ("wide", truth[WIDE_KEY])]:
            losses = {r[li]["per_spec"][key][0] for r in res}
            for loss in losses:
                assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), (layout, key)
                worst["loss"] = max(worst["loss"], abs(loss - ref_loss) / max(abs(ref_loss), 1e-12))
            grads = _merge(res, li, lambda x, k=key: x["per_spec"][k][1])
            assert set(grads) == set(ref_grads), (layout, key, set(grads) ^ set(ref_grads))
            for name, g_ref in ref_grads.items():
                scale = float(g_ref.abs().max())
                torch.testing.assert_close(grads[name], g_ref, rtol=1e-5, atol=1e-5 * scale,
                                           msg=lambda m, n=name, k=key, lay=layout: f"{lay} {k} {n}: {m}")
                worst["grad"] = max(worst["grad"], float((grads[name] - g_ref).abs().max()) / max(scale, 1e-30))
        # kl_loss_coef = 0 gives exactly the no-KL gradient (same layout, same code path)
        g0 = _merge(res, li, lambda x: x["per_spec"][("token-mean", "kl0")][1])
        g1 = _merge(res, li, lambda x: x["per_spec"][("token-mean", "pg")][1])
        for name in g1:
            torch.testing.assert_close(g0[name], g1[name], rtol=0, atol=0)
    # one optimizer step: weights agree across layouts
    w0 = _merge(res, 0, lambda x: x["weights"])
    for li in range(1, len(LAYOUTS)):
        wl = _merge(res, li, lambda x: x["weights"])
        for name, t in w0.items():
            torch.testing.assert_close(wl[name], t, rtol=0, atol=1e-6, msg=lambda m, n=name, lay=LAYOUTS[li]: f"{lay} {n}: {m}")
            worst["weights"] = max(worst["weights"], float((wl[name] - t).abs().max()))
    m = res[0][0]["metrics"]
    for k in ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
              "actor/kl_loss", "actor/kl_coef", "actor/grad_norm", "actor/lr"):
        assert k in m, k
    assert m["actor/lr"] == pytest.approx(1e-3) and m["actor/kl_coef"] == pytest.approx(0.1)
    for li in range(1, len(LAYOUTS)):
        assert res[0][li]["metrics"]["actor/grad_norm"] == pytest.approx(m["actor/grad_norm"], rel=1e-5)
        assert res[0][li]["metrics"]["actor/pg_clipfrac"] == pytest.approx(m["actor/pg_clipfrac"], rel=1e-6)
    print("max deviations:", worst)
