"""Context parallelism on the sdpa backend: CP=2 and CP=4 give the CP=1 log-probs, entropies, loss and gradients.

One fixed ragged batch (8 samples of 3..13 tokens: with CP=4 every sequence is padded to a multiple of 2·CP = 8,
several are shorter than that and some chunks hold only padding), a dense GQA model (tiny Qwen2: 4 query heads,
2 KV heads), packed rows. One 4-rank launch re-initialises Megatron for CP1 (DP4), CP2 (DP2), CP4 (DP1, dynamic
token-budget micro-batches) and
CP2×TP2 (DP1; sequence parallelism needs Apex/TE norms, absent on CPU) and CP2×PP2 (DP1, 4 micro-batches per
rank through 1F1B, every row padded to one length: a padding sequence). Each layout computes the full batch's
log-probs and entropies (forward only), then the loss and the DP×CP-reduced gradient of a token-mean loss with
entropy and KL terms and of a seq-mean-token-mean loss (per-sequence means: a sequence's tokens lie on several CP
ranks), then one optimizer step; the critic's values, value loss and weights after one step at CP2 against CP1.
MoE (:func:`_moe`, :func:`_check_moe`): a tiny Qwen3-MoE at CP2 x EP2 against CP1 x EP2 with routing replay and the
load-balancing loss; MLA: the tiny DeepSeek-V3 (tests/helpers/tiny_deepseek.py, d_qk != d_v, RoPE on part of the head,
which Megatron's MLA applies itself) at CP2 against CP1 (:func:`_cp1_cp2`, :func:`_check_pair`); LoRA on the dense
model (:func:`_lora`); the frozen roles, teacher, separate reference and reward model (:func:`_side`); gpt-oss (sinks,
sliding windows, MoE) at CP2 against CP1.

Truth: the HF model in one process (``reference_impl``: transformers attention, no Megatron), and CP1 directly.
Tolerance 1e-5 (fp32, a 4-layer 64-wide model: sums of at most a few hundred terms per value, each rounding
~6e-8 relative; the same bound the layout test holds TP/PP/DP to).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_deepseek import make_tiny_deepseek_hf
from tests.helpers.tiny_models import make_tiny_hf
from tests.helpers.tiny_moe_checkpoints import make_tiny_moe_hf
from tests.workers.test_reward_model import make_tiny_rm

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(600)]

LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)]  # (cp, tp, pp)
TEMPERATURE = 0.7


def _specs():
    from mrl.config.actor import ActorConfig
    from mrl.workers.loss import ActorLossSpec

    base = ActorLossSpec.from_config(ActorConfig(loss_agg_mode="token-mean"), TEMPERATURE, max_response_length=16)
    return {
        "token-mean": dataclasses.replace(base, entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.1,
                                          kl_loss_type="low_var_kl"),
        "seq-mean-token-mean": dataclasses.replace(base, loss_agg_mode="seq-mean-token-mean"),
    }


def _grads_by_hf_name(worker) -> dict[str, torch.Tensor]:
    """TP-gathered ``main_grad`` under HF names (swap data <-> main_grad)."""
    params = [p for c in worker.model.chunks for p in c.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        return {n: t.clone() for n, t in worker.model.named_parameters_hf()}
    finally:
        for p, d in zip(params, saved):
            p.data = d


def _rank(rank, world, path, moe_path, routed, mla_path, rm_path, gpt_oss_path):
    from megatron.core import parallel_state as ps

    from mrl.config.actor import ActorConfig
    from mrl.config.critic import CriticConfig
    from mrl.workers.actor import ActorWorker
    from mrl.workers.critic import CriticWorker
    from mrl.workers.loss import ActorLossSpec
    from tests.workers.batches import portable, ragged_batch

    batch = ragged_batch()
    results = []
    for cp, tp, pp in LAYOUTS:
        cfg = ActorConfig(
            megatron={"context_parallel_size": cp, "tensor_model_parallel_size": tp, "sequence_parallel": False,
                      "pipeline_model_parallel_size": pp, "attention_backend": "sdpa"},
            use_remove_padding=True, ppo_micro_batch_size_per_gpu=2, use_distributed_optimizer=False,
            # CP4: token-budget micro-batches, 10 tokens per device = rows of up to 40 tokens (2 micro-batches)
            use_dynamic_bsz=cp == 4, ppo_max_token_len_per_gpu=10,
            optim={"lr": 1e-3, "eps": 1e-2, "weight_decay": 0.0, "clip_grad": 0.0},
            use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.05, loss_agg_mode="token-mean",
        )
        actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, temperature=TEMPERATURE,
                            max_response_length=16, seed=1234)
        e = actor.model
        keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_context_parallel_rank() == 0  # and every pipeline stage: its own layers' names
        lp, ent = actor.compute_log_prob(batch)
        per_spec = {}
        for key, spec in _specs().items():
            actor.loss_spec = spec
            m = actor.forward_backward(e.dp_shard(batch))
            grads = _grads_by_hf_name(actor)  # collective over TP: every rank takes part
            per_spec[key] = (m["loss"], grads if keep else None)
        actor.loss_spec = ActorLossSpec.from_config(cfg, TEMPERATURE, max_response_length=16)
        metrics = actor.update_policy(batch)
        weights = {n: t.clone() for n, t in actor.export_hf_weights()}
        from mrl.workers.actor import micro_batch_parts

        n_micro = len(micro_batch_parts(e.dp_shard(batch), micro_batch_size=2, use_dynamic_bsz=cfg.use_dynamic_bsz,
                                        max_tokens=10 * cp, dp_group=e.dp_group))
        results.append({"cp": e.cp_size, "dp": e.dp_size, "n_micro": n_micro, "lp": lp, "ent": ent, "per_spec": per_spec,
                        "pad": metrics["perf/pad_fraction"], "weights": weights if keep else None})
        del actor
        if tp == pp == 1 and cp <= 2:  # the critic: values and one value-loss step at CP2 against CP1
            ccfg = CriticConfig(megatron={"context_parallel_size": cp, "attention_backend": "sdpa"},
                                ppo_micro_batch_size_per_gpu=2, cliprange_value=0.05, use_distributed_optimizer=False,
                                optim={"lr": 1e-3, "eps": 1e-2, "weight_decay": 0.0, "clip_grad": 0.0})
            critic = CriticWorker(ccfg, model_path=path, mini_batch_size_samples=8, seed=1234, remove_padding=True)
            v = critic.compute_values(batch)
            target = torch.linspace(-1, 1, batch.response_length).expand_as(v) * batch.response_mask
            m = critic.update_critic(batch.replace(values=v + 0.02, returns=target))
            w = {n: t.detach().clone() for n, t in critic.model.chunks[0].module.named_parameters()}  # TP1: whole
            results[-1]["critic"] = (v, m["critic/vf_loss"], w)
            del critic
    from tests.workers.batches import ragged_batch as rb

    return portable({"dense": results, "moe": _moe(moe_path, routed),
                     "mla": _cp1_cp2(mla_path, rb(vocab=96)), "lora": _lora(path),
                     "side": _side(path, rm_path), "gpt_oss": _cp1_cp2(gpt_oss_path, rb(vocab=96))})


def _cp1_cp2(path, batch, megatron=None, moe=None, record=False):
    """One model at CP1 (DP4) and CP2 (DP2), micro-batches of one sample (both layouts then run the same token sets
    through every router: the aux loss, a product of two sums over a micro-batch, needs it): log-probs, entropies,
    forward_backward's loss and gradients, one update's metrics and weights; with ``record`` R2's record (the
    routing compute_log_prob keeps with ``routing_replay: old``)."""
    from megatron.core import parallel_state as ps

    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker

    out = []
    for cp in (1, 2):
        cfg = ActorConfig(megatron={"context_parallel_size": cp, "attention_backend": "sdpa", **(megatron or {})},
                          moe=moe or {}, use_remove_padding=True, ppo_micro_batch_size_per_gpu=1,
                          use_distributed_optimizer=False, loss_agg_mode="token-mean",
                          optim={"lr": 1e-3, "eps": 1e-2, "weight_decay": 0.0, "clip_grad": 0.0})
        actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, temperature=TEMPERATURE,
                            max_response_length=16, seed=1234)
        keep = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        lp, ent = actor.compute_log_prob(batch)
        m = actor.forward_backward(actor.model.dp_shard(batch))
        grads = _grads_by_hf_name(actor)  # experts gathered over EP: every rank takes part
        metrics = actor.update_policy(batch)
        weights = {n: t.clone() for n, t in actor.export_hf_weights()}
        out.append({"lp": lp, "ent": ent, "loss": m["loss"], "grads": grads if keep else None, "metrics": metrics,
                    "weights": weights if keep else None})
        del actor
        if record:
            actor = ActorWorker(cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"routing_replay": "old"})}),
                                model_path=path, mini_batch_size_samples=8, temperature=TEMPERATURE,
                                max_response_length=16, seed=1234)
            actor.compute_log_prob(batch.replace(routed_experts=None))
            out[-1]["recorded"] = actor.old_routing.routing.clone()
            del actor
    return out


def _lora(path):
    """LoRA (rank 4, every linear) on the dense model at CP1 (DP4) and CP2 (DP2): log-probs, forward_backward's
    loss and the adapters' gradients, one update, then the adapters (peft tensors), the log-probs and the colocated
    reference's (the base model: adapters off)."""
    from mrl.config.actor import ActorConfig
    from mrl.megatron.lora import export_peft_tensors
    from mrl.workers.actor import ActorWorker
    from mrl.workers.reference import ColocatedReference
    from tests.workers.batches import ragged_batch

    batch = ragged_batch()
    out = []
    for cp in (1, 2):
        cfg = ActorConfig(megatron={"context_parallel_size": cp, "attention_backend": "sdpa"}, use_remove_padding=True,
                          lora={"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"]},
                          ppo_micro_batch_size_per_gpu=2, use_distributed_optimizer=False, loss_agg_mode="token-mean",
                          optim={"lr": 1e-2, "eps": 1e-2, "weight_decay": 0.0, "clip_grad": 0.0})
        actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=8, temperature=TEMPERATURE,
                            max_response_length=16, seed=1234)
        ref = ColocatedReference(actor)
        r = {"lp0": actor.compute_log_prob(batch)[0]}
        r["loss"] = actor.forward_backward(actor.model.dp_shard(batch))["loss"]
        r["grads"] = {n: p.main_grad.clone() for c in actor.model.chunks for n, p in c.named_parameters()
                      if p.requires_grad}
        actor.update_policy(batch)
        r["peft"] = dict(export_peft_tensors(actor.model.chunks))
        r["lp1"], r["ref1"] = actor.compute_log_prob(batch)[0], ref.compute_ref_log_prob(batch)
        out.append(r)
        del actor, ref
    return out


def _side(path, rm_path):
    """The frozen roles at CP1 (DP4) and CP2 (DP2), each in a Megatron state of its own (as a separate placement
    builds them): the teacher's and a separate reference's [B, R] log-probs of the dense model at the rollout
    temperature, and the reward model's [B] scores of 7 samples (DP-padded to 8)."""
    from mrl.config.parallel import ParallelConfig
    from mrl.config.ref import RefConfig
    from mrl.workers.reference import ReferenceWorker
    from mrl.workers.reward_model import RewardModelWorker
    from mrl.workers.teacher import TeacherWorker
    from tests.workers.batches import ragged_batch

    batch = ragged_batch()
    out = []
    for cp in (1, 2):
        par = ParallelConfig(context_parallel_size=cp, attention_backend="sdpa")
        r = {"teacher": TeacherWorker(path, par, micro_batch_size=2, temperature=TEMPERATURE, seed=1234,
                                      remove_padding=True).compute(batch)}
        ref = ReferenceWorker(RefConfig(placement="separate", megatron=par), model_path=path, micro_batch_size=2,
                              temperature=TEMPERATURE, seed=1234, remove_padding=True)
        r["ref"] = ref.compute_ref_log_prob(batch)
        r["rm"] = RewardModelWorker(rm_path, par, micro_batch_size=3, seed=1234).compute(batch.slice(0, 7))
        out.append(r)
    return out


def _moe(path, routed):
    """The Qwen3-MoE at CP1 x EP2 (DP4) and CP2 x EP2 (DP2; the EP pairs are the CP pairs): routing replay of
    engine ids (R3), the load-balancing loss at 0.05, then R2's record."""
    from tests.workers.batches import ragged_batch

    return _cp1_cp2(path, ragged_batch().replace(routed_experts=torch.as_tensor(routed)),
                    {"expert_model_parallel_size": 2}, {"routing_replay": "rollout", "aux_loss_coef": 0.05},
                    record=True)


def test_context_parallel_equals_cp1_and_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_log_probs, hf_loss_and_grads

    path = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    moe_path = make_tiny_hf(tmp_path / "qwen3_moe", "qwen3_moe")
    routed = _engine_ids(moe_path, ragged_batch())
    mla_path = make_tiny_deepseek_hf(tmp_path / "deepseek_v3")
    rm_path = make_tiny_rm(tmp_path / "rm", "qwen2")
    gpt_oss_path = make_tiny_moe_hf(tmp_path / "gpt_oss", "gpt_oss")
    both = tensors(run_ranks(_rank, 4, args=(str(path), str(moe_path), routed, str(mla_path), str(rm_path),
                                             str(gpt_oss_path)), timeout_s=540))
    res = [r["dense"] for r in both]
    _check_moe([r["moe"] for r in both], routed)
    _check_pair([r["mla"] for r in both], "MLA")
    _check_lora([r["lora"] for r in both])
    _check_side([r["side"] for r in both], path, rm_path)
    _check_pair([r["gpt_oss"] for r in both], "gpt-oss")
    batch = ragged_batch()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs(model, batch, TEMPERATURE)
    truth = {k: hf_loss_and_grads(model, batch, s) for k, s in _specs().items()}

    def merged(li, getter):
        out = {}
        for r in res:
            part = getter(r[li])
            if part:
                out.update(part)
        return out

    for li, (cp, tp, pp) in enumerate(LAYOUTS):
        tag = f"CP{cp}TP{tp}PP{pp}"
        assert (res[0][li]["cp"], res[0][li]["dp"]) == (cp, 4 // (cp * tp * pp))
        if cp == 4 or pp == 2:  # token-budget split / 1F1B: several micro-batches per rank
            assert res[0][li]["n_micro"] >= 2
        for r in res:  # every rank holds the full batch's values
            torch.testing.assert_close(r[li]["lp"], ref_lp, rtol=0, atol=1e-5, msg=lambda m, t=tag: f"{t} lp {m}")
            torch.testing.assert_close(r[li]["ent"], ref_ent, rtol=0, atol=1e-5, msg=lambda m, t=tag: f"{t} ent {m}")
            torch.testing.assert_close(r[li]["lp"], res[0][0]["lp"], rtol=0, atol=1e-5)
        for key, (t_loss, t_grads) in truth.items():
            loss = res[0][li]["per_spec"][key][0]
            assert loss == pytest.approx(t_loss, rel=1e-5, abs=1e-7), (tag, key)
            assert loss == pytest.approx(res[0][0]["per_spec"][key][0], rel=1e-5, abs=1e-7), (tag, key)
            grads = merged(li, lambda x, k=key: x["per_spec"][k][1])
            cp1 = merged(0, lambda x, k=key: x["per_spec"][k][1])
            assert set(grads) == set(t_grads) == set(cp1)
            for name, g in t_grads.items():
                tol = 1e-5 * float(g.abs().max())
                torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=tol,
                                           msg=lambda m, n=name, t=f"{tag} {key}": f"{t} grad {n}: {m}")
                torch.testing.assert_close(grads[name], cp1[name], rtol=1e-5, atol=tol)
        w, w1 = merged(li, lambda x: x["weights"]), merged(0, lambda x: x["weights"])
        for name, t in w1.items():  # one Adam step (eps=1e-2: smooth in the gradient)
            torch.testing.assert_close(w[name], t, rtol=1e-5, atol=1e-6, msg=lambda m, n=name, t=tag: f"{t} {n}: {m}")
    v1, loss1, w1 = res[0][0]["critic"]
    v2, loss2, w2 = res[0][1]["critic"]
    assert (v1 != 0).any()
    torch.testing.assert_close(v2, v1, rtol=0, atol=1e-5)
    assert loss2 == pytest.approx(loss1, rel=1e-5)
    assert set(w1) == set(w2) and "output_layer.weight" in w1  # the value head
    for name, t in w1.items():
        torch.testing.assert_close(w2[name], t, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"critic CP2 {n}: {m}")
    # the CP padding (sequences to multiples of 2·CP) is counted: more at CP4 than at CP2, none at CP1
    assert res[0][0]["pad"] == 0.0 < res[0][1]["pad"] < res[0][2]["pad"]


def _engine_ids(path, batch) -> torch.Tensor:
    """[B, S, layers, K] int32 "engine" expert ids for routing replay: K distinct random experts per valid token
    (-1 elsewhere), unrelated to the trainer's own routing, so a token replayed at another token's ids changes
    the log-probs."""
    import json

    c = json.loads((path / "config.json").read_text())
    E, K, L = c.get("num_experts") or c["num_local_experts"], c["num_experts_per_tok"], c["num_hidden_layers"]
    g = torch.Generator().manual_seed(3)
    ids = torch.rand(*batch.input_ids.shape, L, E, generator=g).argsort(-1)[..., :K].int()
    return torch.where(batch.attention_mask.bool()[:, :, None, None], ids, -1)


def _check_pair(res, tag):
    """CP2 against CP1 (:func:`_cp1_cp2`): log-probs, entropies, loss, every gradient and the weights after one
    Adam step (bounds as for the dense model), the moe/* metrics within 1e-6."""
    def merged(li, key):
        out = {}
        for r in res:
            out.update(r[li][key] or {})
        return out

    one, two = res[0]
    for r in res:
        torch.testing.assert_close(r[1]["lp"], one["lp"], rtol=0, atol=1e-5, msg=lambda m: f"{tag} CP2 lp {m}")
        torch.testing.assert_close(r[1]["ent"], one["ent"], rtol=0, atol=1e-5, msg=lambda m: f"{tag} CP2 ent {m}")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7), tag
    g1, g2 = merged(0, "grads"), merged(1, "grads")
    assert set(g1) == set(g2) and any(".mlp.gate." in n or ".mlp.router." in n for n in g1)
    assert any(".experts." in n for n in g1)
    for name, g in g1.items():
        torch.testing.assert_close(g2[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m, n=name: f"{tag} CP2 grad {n}: {m}")
    w1, w2 = merged(0, "weights"), merged(1, "weights")
    assert set(w1) == set(w2)
    for name, t in w1.items():
        torch.testing.assert_close(w2[name], t, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{tag} CP2 {n}: {m}")
    m1, m2 = one["metrics"], two["metrics"]
    assert any(k.startswith("moe/") for k in m1)
    for key in [k for k in m1 if k.startswith("moe/")]:
        assert m2[key] == pytest.approx(m1[key], rel=1e-6), (tag, key)


def _check_moe(res, routed):
    """The MoE pair (:func:`_check_pair`; the gradients include the aux loss's on the router: Megatron sums each
    router's expert counts over TP x CP and divides every CP share's probability sum by the micro-batch's
    valid-token count, read from mrl's padding mask) with the aux loss and replay reported, and R2's record."""
    _check_pair(res, "MoE")
    one, two = res[0]
    assert one["metrics"]["moe/aux_loss"] > 0 and "moe/replay_mismatch" in one["metrics"]
    rec1, rec2 = one["recorded"], two["recorded"]
    assert rec1.shape == routed.shape and bool((rec1 >= 0).any())
    assert torch.equal(rec1, rec2)


def _check_lora(res):
    """LoRA at CP2 against CP1: every rank's log-probs before and after one update and the reference's; the loss;
    each adapter's gradient (rank 0: DDP-reduced over DP x CP, the same on every rank) and adapter after the update."""
    one, two = res[0]
    assert one["grads"] and all(".adapter" in n or "lora" in n for n in one["grads"]), sorted(one["grads"])[:4]
    for r in res:
        for key in ("lp0", "lp1", "ref1"):
            torch.testing.assert_close(r[1][key], one[key], rtol=0, atol=1e-5, msg=lambda m, k=key: f"LoRA CP2 {k} {m}")
    assert not torch.allclose(one["lp1"], one["ref1"], atol=1e-4)  # the update moved the adapters off the base
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert set(one["grads"]) == set(two["grads"]) and set(one["peft"]) == set(two["peft"])
    for name, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()),
                                   msg=lambda m, n=name: f"LoRA CP2 grad {n}: {m}")
    for name, t in one["peft"].items():
        torch.testing.assert_close(two["peft"][name], t, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"LoRA CP2 {n}: {m}")


def _check_side(res, path, rm_path):
    """Teacher, separate reference and reward model at CP2 against CP1 and against transformers (the teacher and
    the reference are the dense model: its log-probs at the rollout temperature; the RM: its sequence
    classifier on each sample alone), on every rank."""
    import transformers as tf

    from tests.workers.batches import ragged_batch
    from tests.workers.reference_impl import hf_log_probs

    batch = ragged_batch()
    rm = tf.AutoModelForSequenceClassification.from_pretrained(rm_path, dtype=torch.float32).eval()
    am = batch.attention_mask.bool()
    with torch.no_grad():
        lm = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        lp = hf_log_probs(lm, batch, TEMPERATURE)[0]
        scores = torch.stack([rm(input_ids=batch.input_ids[i][am[i]][None]).logits[0, 0] for i in range(7)])
    assert float(scores.std()) > 0.05
    for r in res:
        for cp in (0, 1):
            for key, truth in (("teacher", lp), ("ref", lp), ("rm", scores)):
                torch.testing.assert_close(r[cp][key], truth, rtol=0, atol=1e-5, msg=lambda m, k=key, c=cp: f"CP{c + 1} {k} {m}")
                torch.testing.assert_close(r[cp][key], res[0][0][key], rtol=0, atol=1e-5)
