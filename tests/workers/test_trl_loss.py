"""mrl's actor loss and gradient on one GRPO batch equal TRL's own ``GRPOTrainer._compute_loss``.

TRL is the pinned release that ``make install`` puts in ``.venv/oracles`` (requirements-oracles.txt,
reached through tests/helpers/trl_oracle.py, as verl's oracle is); a missing install fails the test,
it never skips. TRL's side is a real ``GRPOTrainer`` (tiny Llama, CPU, ``loss_type="dapo"``, the
benchmark's setting: Σ_t m_t ℓ_t over the generation batch's token count, i.e. token-mean; PPO clip
ε = 0.2, no KL). The same batch (left-padded prompts, right-padded completions, one advantage per
sample, log π_old = the policy's own log-probs plus noise so that ρ ≠ 1 and some tokens clip) goes to
mrl's Megatron actor (``forward_backward``, one gloo rank, micro-batches of 2). Loss agree to 1e-6
relative, the gradient of every weight to 1e-5 of its largest entry. The batch holds no pad token
(transformers' ``padding_idx`` freezes that embedding row; test_reference_update.py covers it) and
|log ρ| stays far below log 3, where mrl's dual clip (c = 3) would start to differ from TRL's loss.
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


def _batch(path: str) -> dict:
    """Left-padded prompts, right-padded completions (tokens >= 3: no pad/bos/eos), advantages."""
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
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": adv,
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
    inputs = {k: d[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs |= {"old_per_token_logps": old, "num_items_in_batch": d["completion_mask"].sum().float()}
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return portable({"loss": float(loss.detach()), "grads": grads, "old": old})


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
    mask = d["completion_mask"]
    batch = TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=d["completion_ids"],
                       response_mask=mask, old_log_probs=old * mask, advantages=d["advantages"][:, None] * mask,
                       uid=torch.arange(B) // 2)
    actor = ActorWorker(ActorConfig(ppo_micro_batch_size_per_gpu=2, loss_agg_mode="token-mean"), model_path=path,
                        mini_batch_size_samples=B, seed=1)
    m = actor.forward_backward(batch)
    return portable({"loss": m["loss"], "clipfrac": m["pg_clipfrac"], "grads": _grads_by_hf_name(actor)})


def test_actor_loss_and_grads_equal_trl_grpo_loss(tmp_path):
    from tests.workers.batches import portable, tensors

    trl_oracle.check_installed()  # fails (never skips) without the pinned TRL in .venv/oracles

    path = str(make_tiny_hf(tmp_path / "llama", "llama"))
    d = _batch(path)
    trl = tensors(run_ranks(_trl_side, 1, args=(path, portable(d)), timeout_s=240, init_process_group=False))[0]
    mrl = tensors(run_ranks(_mrl_side, 1, args=(path, portable(d), portable(trl["old"])), timeout_s=240))[0]
    assert mrl["clipfrac"] > 0, "no token clipped: the clip would go untested"
    assert mrl["loss"] == pytest.approx(trl["loss"], rel=1e-6, abs=1e-8)
    assert set(mrl["grads"]) == set(trl["grads"])
    worst = 0.0
    for name, g in trl["grads"].items():
        scale = float(g.abs().max())
        diff = float((mrl["grads"][name] - g).abs().max())
        worst = max(worst, diff / scale)
        assert diff <= 1e-5 * scale, f"{name}: |Δg| {diff:.3g} > 1e-5 × {scale:.3g}"
    print(f"loss mrl {mrl['loss']:.8f} trl {trl['loss']:.8f}; worst relative grad difference {worst:.3g}")


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
