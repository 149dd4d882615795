"""The teacher of on-policy distillation: its log-probs equal transformers' at TP2, PP2 and DP2 (a batch
that does not divide by DP included; the reference is one transformers forward of the left/right-padded batch
with its attention_mask and position_ids, no mrl input builder: tests/workers/reference_impl.py), a teacher equal to the student gives a reverse KL of 0, and the
actor's distillation loss term (algorithm.distill.mode=kl_loss) is its formula, the same at every layout.

One 2-rank launch; the student is a tiny Qwen2, the teacher a tiny Llama of another width and depth with
the same tokenizer (a teacher's shape is its own)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(900)]

LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}, "dp2": {}}


def _rank(rank, world, student, teacher):
    from mrl.algorithms import agg_loss, distill_metrics, teacher_kl
    from mrl.config.actor import ActorConfig
    from mrl.config.algorithm import DistillConfig
    from mrl.config.parallel import ParallelConfig
    from mrl.workers.actor import ActorWorker
    from mrl.workers.teacher import TeacherWorker
    from tests.workers.batches import grouped_batch, portable, ragged_batch

    out = {}
    batch = ragged_batch(B=8)
    grouped = grouped_batch(groups=2, n=4)  # GRPO-shaped: each prompt computed once with shared_prefix
    odd = ragged_batch(B=7, seed=3)  # not divisible by DP2: padded, the extra rows dropped
    for name, layout in LAYOUTS.items():
        t = TeacherWorker(teacher, ParallelConfig(**layout), micro_batch_size=3, temperature=0.7, seed=1)
        out[f"teacher_{name}"] = t.compute(batch)
        out[f"teacher_odd_{name}"] = t.compute(odd)
        t.shared_prefix = False
        out[f"grouped_compact_{name}"] = t.compute(grouped)
        t.shared_prefix = True
        out[f"grouped_shared_{name}"] = t.compute(grouped)
        del t  # the next worker re-initialises Megatron's groups at its layout
    # teacher == student: the reverse KL is 0 (same weights, same temperature, same kernels)
    cfg = ActorConfig(megatron=LAYOUTS["tp2"], ppo_micro_batch_size_per_gpu=4, optim={"lr": 1e-2, "clip_grad": 1.0},
                      use_kl_loss=False)
    distill = DistillConfig(mode="kl_loss", coef=0.5, estimator="low_var_kl")
    actor = ActorWorker(cfg, model_path=student, mini_batch_size_samples=8, seed=1234, temperature=0.7, distill=distill)
    self_teacher = TeacherWorker(student, cfg.megatron, micro_batch_size=3, temperature=0.7, seed=1,
                                 init_parallel=False)
    lp_student, _ = actor.compute_log_prob(batch)
    out["self_metrics"] = distill_metrics(lp_student, self_teacher.compute(batch), batch.response_mask)
    # the loss term: coef * agg(k3(log pi_theta, log pi_teacher)) at the pre-update weights
    t_lp = out["teacher_tp2"]
    mask = batch.response_mask.float()
    out["expected_distill_loss"] = float(agg_loss(teacher_kl(lp_student, t_lp, "low_var_kl"), mask, "token-mean"))
    m = actor.update_policy(batch.replace(teacher_log_prob=t_lp, advantages=torch.zeros_like(batch.advantages)))
    out["metrics"] = m
    out["lp_after"] = actor.compute_log_prob(batch)[0]
    return portable(out)


def test_teacher_log_probs_self_distillation_and_loss_term(tmp_path):
    from transformers import AutoModelForCausalLM

    from mrl.algorithms import reverse_kl_reward
    from tests.workers.batches import grouped_batch, ragged_batch, tensors
    from tests.workers.reference_impl import hf_padded_log_probs

    student = make_tiny_hf(tmp_path / "student", "qwen2")
    teacher = make_tiny_hf(tmp_path / "teacher", "llama", seed=7, hidden_size=96, intermediate_size=160,
                           num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2)
    res = tensors(run_ranks(_rank, 2, args=(str(student), str(teacher)), timeout_s=840))
    hf = AutoModelForCausalLM.from_pretrained(str(teacher), dtype=torch.float32)
    batch, odd, grouped = ragged_batch(B=8), ragged_batch(B=7, seed=3), grouped_batch(groups=2, n=4)
    with torch.no_grad():  # the reference: transformers on the padded batch as stored (no mrl input builder)
        want_grouped, _ = hf_padded_log_probs(hf, grouped, temperature=0.7)
        want, _ = hf_padded_log_probs(hf, batch, temperature=0.7)
        want_odd, _ = hf_padded_log_probs(hf, odd, temperature=0.7)
    for r in res:
        for name in LAYOUTS:
            torch.testing.assert_close(r[f"teacher_{name}"] * batch.response_mask, want * batch.response_mask,
                                       rtol=0, atol=1e-5)
            assert r[f"teacher_odd_{name}"].shape == odd.response_mask.shape
            torch.testing.assert_close(r[f"teacher_odd_{name}"] * odd.response_mask, want_odd * odd.response_mask,
                                       rtol=0, atol=1e-5)
            gm = grouped.response_mask
            torch.testing.assert_close(r[f"grouped_compact_{name}"] * gm, want_grouped * gm, rtol=0, atol=1e-5)
            # the shared-prompt layout sums in another order: fp32 round-off (1.4e-6 seen on |log p| ~ 6)
            torch.testing.assert_close(r[f"grouped_shared_{name}"] * gm, want_grouped * gm, rtol=0, atol=1e-5)
        assert abs(r["self_metrics"]["distill/reverse_kl"]) <= 1e-6, r["self_metrics"]
        # zero advantages: the update's loss is the distillation term alone, as its formula says
        m = r["metrics"]
        assert m["distill/kl_loss"] == pytest.approx(r["expected_distill_loss"], rel=1e-5, abs=1e-7)
        assert m["distill/kl_loss"] > 1e-3
        # and the step lowered the KL to the teacher
        t_lp = r["teacher_tp2"]
        before = r["expected_distill_loss"]
        from mrl.algorithms import agg_loss, teacher_kl

        after = float(agg_loss(teacher_kl(r["lp_after"], t_lp, "low_var_kl"), batch.response_mask.float(), "token-mean"))
        assert after < before, (before, after)
    # the reward mode's formula on these log-probs (the algorithm's own unit tests cover the edge cases)
    r0 = res[0]
    rew = reverse_kl_reward(r0["lp_after"], r0["teacher_tp2"], batch.response_mask, 2.0)
    torch.testing.assert_close(rew, -2.0 * (r0["lp_after"] - r0["teacher_tp2"]) * batch.response_mask)
