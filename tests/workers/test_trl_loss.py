"""mrl's actor loss and gradient on one GRPO batch equal TRL's own ``GRPOTrainer._compute_loss``.

TRL is the pinned release that ``make install`` puts in ``.venv/oracles`` (requirements-oracles.txt,
reached through tests/helpers/trl_oracle.py, as verl's oracle is); a missing install fails the test,
it never skips. TRL's side is a real ``GRPOTrainer`` (tiny Llama, CPU, ``loss_type="dapo"``, the
benchmark's setting: Σ_t m_t ℓ_t over the generation batch's trained-token count, i.e. token-mean; PPO clip
ε = 0.2, no KL). The same batch (left-padded prompts, right-padded completions, one advantage per
sample, log π_old = the policy's own log-probs plus noise so that ρ ≠ 1 and some tokens clip, and one
completion token masked out of the loss but attended — TRL's ``tool_mask``, mrl's ``response_mask``) goes to
mrl's Megatron actor (``forward_backward``, micro-batches of 2) on one gloo rank and at DP2 (each rank half the
batch: the token-mean's denominator and the gradient's DP reduction must be global). The batch holds no pad
token (transformers' ``padding_idx`` freezes that embedding row; test_reference_update.py covers it) and
|log ρ| stays far below log 3, where mrl's dual clip (c = 3) would start to differ from TRL's loss.

Tolerance (derived, not fitted to a host). Both sides compute in float32: TRL's log-prob head projects in
float32 whatever the model's dtype (trl/kernels: ``hidden.float() @ weight.float()``), mrl's Megatron model
supports no float64, so neither side can be lifted to float64. A float32 reduction of n terms is off by at most
(n − 1)·u·Σ|terms| (u = 2⁻²⁴; Higham, Accuracy and Stability, Thm 4.2), by about √n·u·Σ|terms| when the
rounding errors have random signs, and the reduction order (vector width, blocking, thread count) decides which
errors occur: it differs between CPUs and thread counts. Every value the loss and gradients depend on passes
through D = 5 reductions per layer (q/k/v projection, scores, weighted sum, output projection, MLP) × 4 layers
+ final norm + LM head + log-sum-exp = 23 sequential reductions of at most K = 300 terms (the vocabulary; hidden
64, MLP 128, ≤ 11 tokens): relative error ≤ D·√K·u = 2.4e-5 per implementation, and the loss, a mean of N
per-token terms, adds √N·u. Two implementations: twice that. So: the loss agrees to
``2·u·(D·√K + √N) · S`` with ``S = (1/N)·Σ_t |ℓ_t|`` (the magnitude its terms cancel from: the loss itself is a
small difference of signed terms), the gradient of every weight to ``2·u·D·√K`` of its largest entry, and no
token's ratio lies within that relative distance of a clip boundary (where the two sides could clip differently).
Measured here (AMD EPYC, 2026-12-04): loss 6.1e-8 (DP1) and 7.1e-8 (DP2) apart against a bound of 6.2e-5,
gradients 2.0e-6 of their largest entry against 4.7e-5 (another AMD host saw the former batch's losses 2.5e-7 apart,
over the former fixed 1e-6 relative). The faults this test is shown red on change the loss by ≥ 3e-3 or a gradient
by its whole size: token-mean denominators not reduced over DP (DP2 only), the masked token counted in the
denominator, the clip's max taken as a min, the policy gradient doubled.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import trl_oracle
from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(300)]

B, P, R = 8, 5, 6
MASKED = (0, 2)  # (sample, completion column): inside sample 0's full-width completion (a token follows it)
U = 2.0 ** -24  # float32 unit roundoff
D_CHAIN, K_TERMS = 23, 300  # sequential float32 reductions per value, longest reduction (module docstring)
REL = 2 * U * D_CHAIN * K_TERMS ** 0.5  # two float32 implementations' relative difference bound, 4.8e-5


def _batch(path: str) -> dict:
    """Left-padded prompts, right-padded completions (tokens >= 3: no pad/bos/eos), advantages, and a loss mask
    (TRL's ``tool_mask``) that leaves one token inside a completion out of the loss."""
    g = torch.Generator().manual_seed(7)
    p_len = torch.randint(2, P + 1, (B,), generator=g)
    r_len = torch.randint(1, R + 1, (B,), generator=g)
    p_len[0], r_len[0] = P, R
    cols_p, cols_r = torch.arange(P), torch.arange(R)
    prompt_mask = (cols_p[None] >= (P - p_len)[:, None]).long()
    completion_mask = (cols_r[None] < r_len[:, None]).long()
    prompt_ids = torch.randint(3, 300, (B, P), generator=g) * prompt_mask
    completion_ids = torch.randint(3, 300, (B, R), generator=g) * completion_mask
    adv = torch.randn(B, generator=g)
    tool_mask = torch.ones(B, R, dtype=torch.long)
    tool_mask[MASKED] = 0  # attended as context, not trained (a tool's output inside a response)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "tool_mask": tool_mask, "advantages": adv,
            "noise": 0.3 * torch.randn(B, R, generator=g)}


def _hf_log_probs(model, d) -> torch.Tensor:
    """log π(completion) [B, R] of the HF model, one unpadded sequence at a time."""
    out = torch.zeros(B, R)
    with torch.no_grad():
        for i in range(B):
            p = d["prompt_ids"][i][d["prompt_mask"][i].bool()]
            c = d["completion_ids"][i][d["completion_mask"][i].bool()]
            logits = model(input_ids=torch.cat([p, c])[None]).logits[0, p.numel() - 1: -1]
            out[i, : c.numel()] = torch.log_softmax(logits.float(), -1).gather(-1, c[:, None]).squeeze(-1)
    return out


def _trl_side(rank, world, path, d):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)  # one plain process for accelerate, not a distributed launch
    trl_oracle.require()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tests.workers.batches import portable, tensors

    d = tensors(d)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    old = _hf_log_probs(model, d) + d["noise"] * d["completion_mask"]
    cfg = GRPOConfig(
        output_dir=os.path.join(path, "trl_out"), per_device_train_batch_size=B, gradient_accumulation_steps=1,
        num_generations=2, steps_per_generation=1, num_iterations=1, max_completion_length=R, beta=0.0,
        epsilon=0.2, loss_type="dapo", temperature=1.0, report_to="none", use_cpu=True, bf16=False,
        save_strategy="no", disable_tqdm=True, gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=cfg,
                          train_dataset=Dataset.from_list([{"prompt": "ab"}] * B),
                          processing_class=AutoTokenizer.from_pretrained(path))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages")
    inputs = {k: d[k] for k in keys}
    # TRL's own count (grpo_trainer: num_items_in_batch = Σ completion_mask · tool_mask over the batch)
    inputs |= {"old_per_token_logps": old,
               "num_items_in_batch": (d["completion_mask"] * d["tool_mask"]).sum().float()}
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():  # TRL's per-token log-probs: the terms the loss is a mean of (module docstring)
        lp, _, _ = trainer._get_per_token_logps_and_entropies(
            model, torch.cat([d["prompt_ids"], d["completion_ids"]], 1),
            torch.cat([d["prompt_mask"], d["completion_mask"]], 1), R)
    return portable({"loss": float(loss.detach()), "grads": grads, "old": old, "lp": lp})


def _mrl_side(rank, world, path, d, old):
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from mrl.workers.batch import TrainBatch
    from tests.workers.batches import portable, tensors
    from tests.workers.test_layout_invariance import _grads_by_hf_name

    d, old = tensors(d), tensors(old)
    ids = torch.cat([d["prompt_ids"], d["completion_ids"]], 1)
    am = torch.cat([d["prompt_mask"], d["completion_mask"]], 1)
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    mask = d["completion_mask"] * d["tool_mask"]
    batch = TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=d["completion_ids"],
                       response_mask=mask, old_log_probs=old * mask, advantages=d["advantages"][:, None] * mask,
                       uid=torch.arange(B) // 2)
    # plain DP: every rank holds the whole DP-reduced gradient (the distributed optimizer keeps a shard of it)
    actor = ActorWorker(ActorConfig(ppo_micro_batch_size_per_gpu=2, loss_agg_mode="token-mean",
                                    use_distributed_optimizer=False), model_path=path,
                        mini_batch_size_samples=B, seed=1)
    m = actor.forward_backward(actor.model.dp_shard(batch))  # DP2: this rank's half of the batch
    grads = _grads_by_hf_name(actor)  # DP-reduced: the same on every rank
    return portable({"loss": m["loss"], "clipfrac": m["pg_clipfrac"], "grads": grads, "dp": actor.model.dp_size})


def _loss_scale(trl, d) -> float:
    """S = (1/N)·Σ_t |ℓ_t| over the trained tokens, from TRL's per-token log-probs (module docstring); asserts no
    ratio within REL of a clip boundary, where float32 rounding could clip a token on one side only."""
    m = (d["completion_mask"] * d["tool_mask"]).bool()
    ratio = torch.exp(trl["lp"].double() - trl["old"].double())[m]
    adv = d["advantages"][:, None].double().expand(B, R)[m]
    for edge in (0.8, 1.2):
        gap = float((ratio / edge - 1).abs().min())
        assert gap > REL, f"a ratio lies {gap:.3g} from the clip boundary {edge}: choose another batch seed"
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return float(per_token.abs().mean())


def test_actor_loss_and_grads_equal_trl_grpo_loss(tmp_path):
    from tests.workers.batches import portable, tensors

    trl_oracle.check_installed()  # fails (never skips) without the pinned TRL in .venv/oracles

    path = str(make_tiny_hf(tmp_path / "llama", "llama"))
    d = _batch(path)
    trl = tensors(run_ranks(_trl_side, 1, args=(path, portable(d)), timeout_s=240, init_process_group=False))[0]
    n_tok = int((d["completion_mask"] * d["tool_mask"]).sum())
    assert n_tok < int(d["completion_mask"].sum()) and d["completion_mask"][MASKED] == 1  # a masked token inside
    loss_tol = 2 * U * (D_CHAIN * K_TERMS ** 0.5 + n_tok ** 0.5) * _loss_scale(trl, d)
    report = []
    for world in (1, 2):
        mrl = tensors(run_ranks(_mrl_side, world, args=(path, portable(d), portable(trl["old"])), timeout_s=240))[0]
        assert mrl["dp"] == world
        assert mrl["clipfrac"] > 0, "no token clipped: the clip would go untested"
        d_loss = abs(mrl["loss"] - trl["loss"])
        assert d_loss <= loss_tol, f"DP{world}: loss mrl {mrl['loss']:.10f} trl {trl['loss']:.10f}: " \
                                   f"|Δ| {d_loss:.3g} > {loss_tol:.3g}"
        assert set(mrl["grads"]) == set(trl["grads"])
        worst = 0.0
        for name, g in trl["grads"].items():
            scale = float(g.abs().max())
            diff = float((mrl["grads"][name] - g).abs().max())
            worst = max(worst, diff / scale)
            assert diff <= REL * scale, f"DP{world} {name}: |Δg| {diff:.3g} > {REL:.3g} × {scale:.3g}"
        report.append(f"DP{world}: loss mrl {mrl['loss']:.10f} trl {trl['loss']:.10f} (|Δ| {d_loss:.3g}, bound "
                      f"{loss_tol:.3g}); worst relative grad difference {worst:.3g} (bound {REL:.3g})")
    print("\n".join(report))


def test_oracle_pins_are_the_benchmarks():
    """The TRL this test compares against is the one benchmarks/vs_trl.py runs (requirements-bench.txt, setup.py's
    bench extra): same trl and datasets pins."""
    import re

    repo = trl_oracle.REQUIREMENTS.parent

    def pins(text: str) -> dict[str, str]:
        return dict(re.findall(r"""["']?\b(trl|datasets)==([\w.]+)""", text))

    oracle = pins(trl_oracle.REQUIREMENTS.read_text())
    assert set(oracle) == {"trl", "datasets"}, oracle
    assert pins((repo / "requirements-bench.txt").read_text()) == oracle
    assert pins((repo / "setup.py").read_text()) == oracle
