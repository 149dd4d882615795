"""The MoE families added for issue 44 (DeepSeek-V3, GLM-4.5, gpt-oss) through the actor, as
tests/workers/test_moe_actor.py does for Qwen3-MoE: log-probs equal transformers', and one update's loss,
gradients and weights after the step do not depend on the layout (DP4 on padded rows, EP2 on packed rows, EP2 x PP2
on packed rows; DeepSeek-V3 also at EP2 x PP2 with uneven pipeline stages, its dense layer 0 alone on stage 0). One
4-rank gloo launch covers the three families and the gpt-oss aux-loss run.

Gradients are the ones the update used, recovered from the weights after its one Adam step: on Adam's first step
(m^ = g, v^ = g², no weight decay, no clipping) a weight moves by ``lr · g / (|g| + eps)``, so with
``y = (w_before - w_after) / lr`` the gradient is ``g = eps · y / (1 - |y|)`` exactly; lr 1e4 and eps 1 make the
float32 weights resolve g to ~1e-12 absolute and ~1e-7 relative (a rarely routed expert's gradient is ~1e-7).

The layout runs have the load-balancing loss off (``actor.moe.aux_loss_coef: 0``): it is a function of each
micro-batch's token set, and the EP2 x PP2 layout (DP2) groups the samples into micro-batches differently from
DP4. mrl passes Megatron's routers the padding mask (``ModelInputs.padding_mask``), so padding positions route but
stay out of the aux loss: two gpt-oss runs with the aux loss on (coefficient 0.1), DP4 on padded rows and EP2 (DP4,
the same micro-batches) on packed rows, must agree in loss, reported aux loss and gradients. The aux loss itself:

* gpt-oss: transformers has one (``GptOssForCausalLM``, ``output_router_logits``, ``load_balancing_loss_func`` of
  modeling_gpt_oss). The DP4 layout run (padded micro-batches of a rank's 2 samples, coefficient 0.1) must report, as
  ``moe/load_balancing_loss``, that function over each micro-batch's valid tokens (each sample's tokens from
  column 0, right-padded with token 0 to the longer one, the padding left out by its ``attention_mask``),
  per layer, divided by top-k (Megatron's token share is per token, transformers' per top-k slot), averaged over
  layers and ranks; ``moe/aux_loss`` = 0.1 x that. Its gradient: that run's minus a coefficient-0 run's
  gradient (same layout, same batch) equals the gradient of the aux term computed here by autograd through
  transformers (each layer's coef·lb/k of each micro-batch, averaged over the 4 data-parallel ranks), the padding
  token's embedding row included (0 in both: transformers' ``padding_idx``, Megatron's masked padding).
* DeepSeek-V3 and GLM-4.5: transformers 5.24's DeepseekV3ForCausalLM / Glm4MoeForCausalLM compute no auxiliary loss
  (no ``load_balancing_loss_func``, no ``router_aux_loss_coef``; their routers are the aux-loss-free sigmoid + bias
  ones), so there is no independent formula to check one against; config.json carries no coefficient, mrl runs
  them with none (checked: no ``moe/aux_loss`` reported) and keeps the score-correction bias frozen (checked: the
  bias after the update is the checkpoint's).

Independent side: transformers built from the checkpoint (``reference_impl.hf_padded_log_probs``: its own
attention_mask / position_ids forward of the padded batch, no mrl input builder), and for the aux loss the router
logits transformers reports.

Gradients in scale and direction: every layout's update gradient (and its reported pg loss) equals transformers'
autograd of the same objective written out in tests/workers/moe_objective.py (the clipped surrogate, token-mean,
on transformers' log-probs; for the gpt-oss aux runs plus the aux term above), per tensor within the float32 bound
derived there (``2·u·D·√K`` of the tensor's largest entry: 1.5e-5 for the 2-layer families, 2.7e-5 for the 4-layer
DeepSeek-V3). Comparing layouts with each other cannot see a scale on the policy gradient (every layout has it),
nor the difference g_aux − g_0 a scale on the policy term or a dropped aux term shared by both runs.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]

FAMILIES = ("deepseek_v3", "glm4_moe", "gpt_oss")
LAYOUTS = [  # (tp, pp, ep, etp, micro-batch size), packed rows, uneven pipeline split
    ((1, 1, 1, 1, 2), False, {}),  # DP4, padded rows
    ((1, 1, 2, 1, 2), True, {}),   # EP2 (DP4), packed rows
    ((1, 2, 2, 1, 2), True, {}),   # EP2 x PP2 (DP2), packed rows
]
# DeepSeek-V3 also at EP2 x PP2 with an uneven split, stage 0 = the dense layer 0 alone, stage 1 = the 3 MoE
# layers (ParallelConfig.num_layers_in_first_pipeline_stage through the actor to Megatron)
UNEVEN_STAGES = {"deepseek_v3": (((1, 2, 2, 1, 2), True, {"num_layers_in_first_pipeline_stage": 1}), [[1], [2, 3, 4]])}


def _layouts(fam):
    return LAYOUTS + ([UNEVEN_STAGES[fam][0]] if fam in UNEVEN_STAGES else [])
AUX = 0.1  # the gpt-oss aux runs' coefficient (large enough that its gradient stands out of float noise)
LR, EPS = 1e4, 1.0  # one Adam step that the gradient can be read back from (module docstring)
VOCAB = 96
LP_TOL = 1e-5    # fp32 log-probs vs transformers
GRAD_TOL = 1e-5  # per tensor: |g - g_DP4| <= 1e-5 * max|g_DP4| (+ rtol 1e-5)


def _cfg(tp, pp, ep, etp, mbs, *, aux=0.0, uneven=None):
    from mrl.config.actor import ActorConfig

    return ActorConfig(
        megatron={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                  "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp, **(uneven or {})},
        moe={"aux_loss_coef": aux},
        ppo_micro_batch_size_per_gpu=mbs,
        optim={"lr": LR, "eps": EPS, "weight_decay": 0.0, "clip_grad": 0.0},
        loss_agg_mode="token-mean",
    )


def _one_update(path, cfg, packed, batch):
    from megatron.core import parallel_state as ps

    from mrl.workers.actor import ActorWorker

    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, seed=1234, remove_padding=packed,
                        attention_backend="sdpa")
    keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    lp, _ = actor.compute_log_prob(batch)
    metrics = actor.update_policy(batch)
    weights = {n: t.clone() for n, t in actor.export_hf_weights()}
    stage = (ps.get_pipeline_model_parallel_rank(), [m.layer_number for c in actor.model.chunks
                                                     for m in c.modules() if hasattr(m, "layer_number")
                                                     and type(m).__name__ == "TransformerLayer"])
    del actor
    return {"lp": lp, "loss": metrics["actor/pg_loss"], "weights": weights if keep else None, "metrics": metrics,
            "stage": stage}


def _rank(rank, world, paths):
    from tests.workers.batches import portable, ragged_batch

    batch = ragged_batch(vocab=VOCAB)
    out = {}
    for fam, path in paths.items():
        out[fam] = [_one_update(path, _cfg(*lay, uneven=uneven), packed, batch) for lay, packed, uneven in _layouts(fam)]
    if "gpt_oss" in paths:  # with the aux loss: DP4 on padded rows, EP2 (same micro-batches) on packed rows
        out["gpt_oss_aux"] = [_one_update(paths["gpt_oss"], _cfg(*lay, aux=AUX), packed, batch)
                              for lay, packed, _ in LAYOUTS[:2]]
    return portable(out)


def _pairs(batch):
    """The DP4 padded layout's micro-batches: per rank its 2 samples' valid tokens from column 0, right-padded with
    token 0 to the longer one (Megatron's rows; position = column, causal attention only), and which columns hold
    a token (transformers' attention_mask)."""
    am = batch.attention_mask.bool()
    for r in range(batch.input_ids.shape[0] // 2):
        n = am[2 * r: 2 * r + 2].sum(-1)
        rows = torch.zeros(2, int(n.max()), dtype=torch.long)
        for i in range(2):
            rows[i, : n[i]] = batch.input_ids[2 * r + i][am[2 * r + i]]
        yield rows, (torch.arange(rows.shape[1]) < n.unsqueeze(1)).long()


def _gpt_oss_aux(path, batch):
    """(moe/load_balancing_loss, {hf name: d(aux term)/d param}) from transformers (module docstring)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    E, k = model.config.num_local_experts, model.config.num_experts_per_tok
    vals, term = [], 0.0
    for rows, mask in _pairs(batch):
        # right padding under a causal mask: the valid positions' router logits are those of the unpadded rows
        rl = model(input_ids=rows, output_router_logits=True).router_logits
        per_layer = [load_balancing_loss_func((x,), E, k, attention_mask=mask) / k for x in rl]
        vals += [float(v.detach()) for v in per_layer]
        term = term + AUX * sum(per_layer)  # each layer's aux loss is added to the loss it backpropagates with
    ranks = batch.input_ids.shape[0] // 2
    (term / ranks).backward()  # the data-parallel average of the ranks' gradients
    grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in model.named_parameters()}
    return sum(vals) / len(vals), grads


def _merged(rank_results, key):
    return {n: t for r in rank_results for n, t in (r[key] or {}).items()}


def _step_grads(rank_results, ckpt):
    """{hf name: the gradient of the update} from the weights after its Adam step (module docstring); frozen
    tensors (the router's score-correction bias) are left out after checking they did not move."""
    out = {}
    for n, w in _merged(rank_results, "weights").items():
        if n.endswith("e_score_correction_bias"):  # a buffer, frozen during RL (docs/moe.md)
            assert torch.equal(w, ckpt[n]), n
            continue
        y = (ckpt[n].double() - w.double()) / LR
        out[n] = EPS * y / (1 - y.abs())
    return out


def test_new_moe_families_actor_layout_invariance_and_gpt_oss_aux_loss(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.helpers.tiny_deepseek import make_tiny_deepseek_hf
    from tests.helpers.tiny_moe_checkpoints import make_tiny_moe_hf
    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.moe_objective import (
        grad_deviation,
        objective_grads,
        relative_bound,
    )
    from tests.workers.reference_impl import hf_padded_log_probs

    paths = {"deepseek_v3": str(make_tiny_deepseek_hf(tmp_path / "deepseek_v3")),
             "glm4_moe": str(make_tiny_moe_hf(tmp_path / "glm4_moe", "glm4_moe")),
             "gpt_oss": str(make_tiny_moe_hf(tmp_path / "gpt_oss", "gpt_oss"))}
    res = tensors(run_ranks(_rank, 4, args=(paths,), timeout_s=560))
    batch = ragged_batch(vocab=VOCAB)
    report, failures = [], []
    for fam, path in paths.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            ref_lp, _ = hf_padded_log_probs(model, batch)
        ckpt = load_file(str(tmp_path / fam / "model.safetensors"))
        # transformers' autograd of the objective (tests/workers/moe_objective.py) and its float32 bound
        want, bound = objective_grads(model, batch, tmp_path / f"{fam}_grads"), relative_bound(model.config)
        g0 = _step_grads([r[fam][0] for r in res], ckpt)
        base_loss = res[0][fam][0]["loss"]
        # the gradient reaches every MoE layer's experts and router (the check is not vacuous)
        assert all(float(g.abs().max()) > 0 for n, g in g0.items() if ".mlp." in n and "experts." not in n), fam
        assert any("experts." in n and float(g.abs().max()) > 1e-6 for n, g in g0.items()), fam
        for li, (lay, packed, uneven) in enumerate(_layouts(fam)):
            tag = f"{fam} {lay} packed={packed}" + (f" {uneven}" if uneven else "")
            if uneven:  # Megatron really built the uneven stages (else this run repeats the even one)
                built = sorted({tuple(r[fam][li]["stage"][1]): r[fam][li]["stage"][0] for r in res}.items(),
                               key=lambda kv: kv[1])
                assert [list(layers) for layers, _ in built] == UNEVEN_STAGES[fam][1], (tag, built)
            d_lp = max(float((r[fam][li]["lp"] - ref_lp).abs().max()) for r in res)
            d_loss = max(abs(r[fam][li]["loss"] - base_loss) for r in res)
            grads = _step_grads([r[fam][li] for r in res], ckpt)
            assert set(grads) == set(g0), (tag, set(grads) ^ set(g0))
            rel = {n: float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12) for n, g in g0.items()}
            worst = max(rel, key=rel.get)
            d_hf, worst_hf = grad_deviation(grads, want["grads"])
            d_loss_hf = max(abs(r[fam][li]["loss"] - want["pg_loss"]) for r in res)
            report.append(f"{tag}: |lp - hf| {d_lp:.2e}, |loss - DP4| {d_loss:.2e}, "
                          f"grad max rel {rel[worst]:.2e} ({worst}); vs transformers' autograd: grad {d_hf:.2e} "
                          f"({worst_hf}), loss {d_loss_hf:.2e} (bounds {bound:.2e}, {bound * want['scale']:.2e})")
            if d_hf > bound:
                failures.append(f"{tag}: gradient {worst_hf} {d_hf:.3g} (relative to its max) from transformers' "
                                f"autograd of the objective, bound {bound:.3g}")
            if d_loss_hf > bound * want["scale"]:
                failures.append(f"{tag}: pg loss {d_loss_hf:.3g} from transformers' {want['pg_loss']:.8f}")
            if d_lp > LP_TOL:
                failures.append(f"{tag}: actor log-probs {d_lp:.3g} from transformers'")
            if d_loss > 1e-7 + 1e-5 * abs(base_loss):
                failures.append(f"{tag}: loss {d_loss:.3g} from the DP4 layout's")
            if rel[worst] > GRAD_TOL:
                failures.append(f"{tag}: gradient {worst} {rel[worst]:.3g} (relative to its max) from DP4's")
            if "moe/aux_loss" in res[0][fam][li]["metrics"]:  # coefficient 0: Megatron computes none
                failures.append(f"{tag}: moe/aux_loss reported with the coefficient 0")
    # gpt-oss aux loss vs transformers' load_balancing_loss_func, and its gradient
    lb, want_g = _gpt_oss_aux(paths["gpt_oss"], batch)
    m_aux = res[0]["gpt_oss_aux"][0]["metrics"]
    report.append(f"gpt_oss aux: moe/load_balancing_loss {m_aux.get('moe/load_balancing_loss')} vs transformers "
                  f"{lb:.8f}; moe/aux_loss {m_aux.get('moe/aux_loss')}")
    ckpt = load_file(str(tmp_path / "gpt_oss" / "model.safetensors"))
    g_aux, g_0 = _step_grads([r["gpt_oss_aux"][0] for r in res], ckpt), _step_grads([r["gpt_oss"][0] for r in res], ckpt)
    # packed rows balance the same tokens as padded ones (padding masked): same aux loss, loss and gradients
    m_packed, g_packed = res[0]["gpt_oss_aux"][1]["metrics"], _step_grads([r["gpt_oss_aux"][1] for r in res], ckpt)
    rel_packed = max(float((g_packed[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12) for n, g in g_aux.items())
    report.append(f"gpt_oss aux, EP2 packed vs DP4 padded: moe/load_balancing_loss {m_packed['moe/load_balancing_loss']} "
                  f"vs {m_aux['moe/load_balancing_loss']}, grad max rel {rel_packed:.2e}")
    assert set(g_0) == set(want_g), set(g_0) ^ set(want_g)  # gpt-oss exports its experts fused, as transformers
    # the whole objective, policy + aux, against transformers' autograd: DP4 padded and EP2 packed
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    oss = AutoModelForCausalLM.from_pretrained(paths["gpt_oss"], dtype=torch.float32).eval()
    want_all, oss_bound = objective_grads(oss, batch, tmp_path / "oss_aux_grads", aux_coef=AUX,
                                         lb_func=load_balancing_loss_func), \
        relative_bound(oss.config)
    for tag, g in (("DP4 padded", g_aux), ("EP2 packed", g_packed)):
        d_hf, worst_hf = grad_deviation(g, want_all["grads"])
        report.append(f"gpt_oss aux {tag}: grad vs transformers' autograd of policy + aux {d_hf:.2e} ({worst_hf}), "
                      f"bound {oss_bound:.2e}")
        if d_hf > oss_bound:
            failures.append(f"gpt_oss aux {tag}: gradient {worst_hf} {d_hf:.3g} from transformers' autograd of "
                            f"policy + aux, bound {oss_bound:.3g}")
    d_aux = {n: g_aux[n] - g_0[n] for n in want_g}
    pad_row = float(d_aux["model.embed_tokens.weight"][0].abs().max())  # the padding token's row (docstring)
    worst = max(float((d_aux[n] - want.double()).abs().max()) for n, want in want_g.items())
    scale = max(float(w.abs().max()) for w in want_g.values())
    report.append(f"gpt_oss aux gradient: max |(g_aux - g_0) - d(aux)/dθ| {worst:.2e} (max |d(aux)/dθ| {scale:.2e}); "
                  f"padding token's embedding row {pad_row:.2e}")
    print("\n".join(report))
    assert not failures, "\n".join(failures)
    assert want_all["lb"] == pytest.approx(lb, rel=1e-12)  # the two written-out aux computations agree
    assert m_aux["moe/load_balancing_loss"] == pytest.approx(lb, rel=1e-6), (m_aux, lb)
    assert m_aux["moe/aux_loss"] == pytest.approx(AUX * lb, rel=1e-6), m_aux
    assert m_packed["moe/load_balancing_loss"] == pytest.approx(m_aux["moe/load_balancing_loss"], rel=1e-6), report
    assert rel_packed <= GRAD_TOL, report
    assert scale > 1e-4, "the aux term has no gradient: the check lost its power"
    assert worst <= 1e-5 * scale, report[-1]  # the padding row included: padding positions are out of the aux loss
