"""mrl's GRPO update equals a plain-PyTorch one, weight for weight, for 20 consecutive steps.

The reference is written out here from the formulas, independent of mrl's loss, batch and
Megatron code: the transformers model, one sequence at a time (no padding), ``torch.optim.AdamW``
and ``torch.nn.utils.clip_grad_norm_``. Per step (GRPO, no KL, no entropy bonus):

* the batch: ``PROMPTS`` prompts (2..P tokens) × ``N`` responses sampled from the *reference's*
  current policy (softmax(z/T), fixed generator; the stop position drawn like an EOS would be),
  reward ``r_i`` = fraction of response tokens whose id is divisible by 3;
* advantages: ``A_i = (r_i − mean_g r) / (std_g r + 1e-6)`` over the sample's group, unbiased std;
* old log-probs ``log π_old`` of the whole batch before the first optimizer step;
* two mini-batches (``ppo_mini_batch_size`` = half the prompts), each one AdamW step on the clipped
  token-mean objective (PPO clip with verl's dual clip, c = 3):

      ρ_t = exp(log π_θ(a_t) − log π_old(a_t))
      ℓ_t = max(−A ρ_t, −A clip(ρ_t, 1 − ε_low, 1 + ε_high));   ℓ_t = min(ℓ_t, −c A) where A < 0
      L   = Σ_t m_t ℓ_t / Σ_t m_t                       (over the whole mini-batch, all DP ranks)

  then ``g ← g · min(1, max_norm / (‖g‖₂ + 1e-6))`` (Megatron's global-norm clip = torch's), then
  AdamW with weight decay on matrices only (Megatron's default groups: no decay on biases and
  1-D parameters, as HF's Trainer does).

Which samples form a mini-batch is a layout choice mrl shares with verl: each DP rank takes its
contiguous slice of the step batch and splits *that* into mini-batches, so global mini-batch k is
the union over DP ranks d of slice d's k-th part. The reference takes the same partition (``dp``);
with DP = 1 it is the plain first-half / second-half split. mrl gets the same batches (as the
trainer builds them: advantages from the token-level rewards by mrl's ``grpo`` estimator, log π_old
from ``compute_log_prob``) and runs ``update_policy``, its real Megatron path (DDP, distributed
optimizer, micro-batches of 2 samples, gloo ranks), at DP1 (compact rows), DP2 and TP2 (shared-prefix
rows). After every step the HF-named weights must agree to ≤ 1e-5 (fp32, tiny Llama with GQA and
untied embeddings).

Two findings the test pins down:

* transformers' ``nn.Embedding(padding_idx=pad_token_id)`` zeroes the pad row's gradient wherever
  that token occurs, also when the policy *samples* it inside a response (step 1 here does): HF (and
  so TRL) then leaves that row untrained and, through the global-norm clip, scales every other
  gradient differently. mrl computes the objective's true gradient; the reference drops
  ``padding_idx`` to follow the formula.
* The learning rate is 1e-4 (Adam ε = 1e-8, mrl's default). Adam's step ``lr·m̂/(√v̂ + ε)`` of a weight
  whose gradient is ~1e-7 (a few per step in this model) is as sensitive as ``lr·ε/(|g| + ε)²`` to it,
  so fp32 rounding between two correct implementations (gradients equal to ~1e-5 of their largest
  entry, tests/workers/test_layout_invariance.py) moves those weights by a few % of lr: measured
  7.7e-5 after one step at lr 2e-3, ≤ 5e-6 over 20 steps at 1e-4, while the weights move ~2.5e-3.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(300)]

STEPS = 20
PROMPTS, N = 4, 4  # prompts per step, samples per prompt
P_MAX, R_MAX = 6, 6  # prompt / response tokens at most
TEMPERATURE = 1.0
LR, WEIGHT_DECAY, CLIP_GRAD = 1e-4, 0.01, 1.0
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.2, 3.0
MICRO = 2  # samples per micro-batch on one rank
TOL = 1e-5
# name: (ranks, TP, actor.shared_prefix): the compact rows and the shared-prefix rows (auto's choice on CPU for
# GRPO-shaped batches like these) must both give the reference's update
LAYOUTS = {"dp1": (1, 1, False), "dp2": (2, 1, True), "tp2": (2, 2, True)}


# ---- the reference ---------------------------------------------------------------------------
def _seq_log_probs(model, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """log π(a_t | prompt, a_<t) [r] of one unpadded sequence, at temperature T."""
    ids = torch.cat([prompt, response])[None]
    logits = model(input_ids=ids).logits[0, prompt.numel() - 1: -1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1)


@torch.no_grad()
def _sample_step(model, step: int) -> dict:
    """One step's samples from the model's current policy, as lists of unpadded token tensors."""
    g = torch.Generator().manual_seed(1000 + step)
    prompts, responses, rewards = [], [], []
    for _ in range(PROMPTS):
        prompt = torch.randint(3, model.config.vocab_size, (int(torch.randint(2, P_MAX + 1, (1,), generator=g)),),
                               generator=g)
        for _ in range(N):
            length = int(torch.randint(1, R_MAX + 1, (1,), generator=g))  # where an EOS would have stopped it
            seq = prompt
            for _ in range(length):
                logits = model(input_ids=seq[None]).logits[0, -1].float() / TEMPERATURE
                seq = torch.cat([seq, torch.multinomial(torch.softmax(logits, -1), 1, generator=g)])
            response = seq[prompt.numel():]
            prompts.append(prompt)
            responses.append(response)
            rewards.append(float((response % 3 == 0).float().mean()))
    return {"prompts": prompts, "responses": responses, "rewards": torch.tensor(rewards)}


def _grpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """A_i = (r_i − mean) / (std + 1e-6) within each group of N adjacent samples (unbiased std)."""
    r = rewards.view(PROMPTS, N)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()


def _mini_batches(dp: int) -> list[list[int]]:
    """Sample indices of each global mini-batch: DP rank d's slice, split in two, the k-th parts joined."""
    B = PROMPTS * N
    per, half = B // dp, B // dp // 2
    return [[d * per + k * half + j for d in range(dp) for j in range(half)] for k in range(2)]


class Reference:
    """Plain PyTorch GRPO: the HF model, torch.optim.AdamW, clip_grad_norm_."""

    def __init__(self, model, dp: int) -> None:
        # transformers builds the embedding with padding_idx = pad_token_id, which zeroes that row's
        # gradient wherever the token occurs; here the policy can sample it inside a response (step 1
        # does), where it is an input like any other. The objective's gradient includes that row, and
        # Megatron (mrl) computes it: the reference follows the formula, not the HF convention.
        model.get_input_embeddings().padding_idx = None
        self.model, self.dp = model, dp
        decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
        no_decay = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.999), eps=1e-8)
        self.clipped = 0  # optimizer steps whose gradient norm exceeded CLIP_GRAD

    def step(self, data: dict) -> None:
        adv = _grpo_advantages(data["rewards"])
        with torch.no_grad():
            old = [_seq_log_probs(self.model, p, r) for p, r in zip(data["prompts"], data["responses"])]
        for idx in _mini_batches(self.dp):
            self.opt.zero_grad(set_to_none=True)
            total, n_tok = 0.0, sum(data["responses"][i].numel() for i in idx)
            for i in idx:
                lp = _seq_log_probs(self.model, data["prompts"][i], data["responses"][i])
                ratio = torch.exp(lp - old[i])
                a = adv[i]
                loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
                if a < 0:
                    loss = torch.minimum(loss, -a * CLIP_C)
                total = total + loss.sum() / n_tok
            total.backward()
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_GRAD)
            self.clipped += int(norm > CLIP_GRAD)
            self.opt.step()


# ---- mrl --------------------------------------------------------------------------------------
def _train_batch(data: dict):
    """The trainer's TrainBatch: prompts left-padded to P_MAX, responses right-padded to R_MAX, uid per
    prompt, the reward on the last response token."""
    from mrl.workers.batch import TrainBatch

    B = len(data["prompts"])
    ids = torch.zeros(B, P_MAX + R_MAX, dtype=torch.long)
    am = torch.zeros_like(ids)
    scores = torch.zeros(B, R_MAX)
    for i, (p, r) in enumerate(zip(data["prompts"], data["responses"])):
        ids[i, P_MAX - p.numel(): P_MAX], ids[i, P_MAX: P_MAX + r.numel()] = p, r
        am[i, P_MAX - p.numel(): P_MAX + r.numel()] = 1
        scores[i, r.numel() - 1] = data["rewards"][i]
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    batch = TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, P_MAX:].clone(),
                       response_mask=am[:, P_MAX:].clone(), uid=torch.arange(B) // N)
    return batch, scores


def _rank(rank, world, path, tp, shared_prefix, steps):
    from megatron.core import parallel_state as ps

    from mrl.algorithms.advantages import get_adv_estimator
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import portable, tensors

    cfg = ActorConfig(
        megatron={"tensor_model_parallel_size": tp}, ppo_mini_batch_size=PROMPTS // 2, shared_prefix=shared_prefix,
        ppo_micro_batch_size_per_gpu=MICRO, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
        optim={"lr": LR, "weight_decay": WEIGHT_DECAY, "clip_grad": CLIP_GRAD},
    )
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=PROMPTS // 2 * N, temperature=TEMPERATURE,
                        seed=1234)
    grpo = get_adv_estimator("grpo")
    keep = rank == 0
    out = []
    for data in tensors(steps):
        batch, scores = _train_batch(data)
        lp, _ = actor.compute_log_prob(batch)
        adv, _ = grpo(scores, batch.response_mask.float(), index=batch.uid)
        metrics = actor.update_policy(batch.replace(old_log_probs=lp, advantages=adv))
        weights = {n: t.clone() for n, t in actor.export_hf_weights()}  # collective over TP
        out.append({"weights": weights if keep else None, "grad_norm": metrics["actor/grad_norm"]})
    assert ps.get_data_parallel_world_size() == world // tp
    return portable(out)


_REFERENCE: dict[int, tuple[list, list]] = {}  # dp -> (steps' samples, weights after each step)


def _reference(path, dp: int):
    if dp not in _REFERENCE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # ~1000 tiny forwards: 3 ms each on one thread, ~40 ms on two busy cores
        try:
            _REFERENCE[dp] = _run_reference(path, dp)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCE[dp]


def _run_reference(path, dp: int) -> tuple[list, list]:
    """The steps' samples and the reference's weights after each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ref = Reference(model, dp)
    steps, weights = [], []
    for s in range(STEPS):
        data = _sample_step(model, s)
        ref.step(data)
        steps.append(data)
        weights.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    assert ref.clipped > 0, "grad clipping never acted: the test would not exercise it"
    return steps, weights


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("ref_update") / "llama", "llama")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_updates_equal_plain_pytorch_reference(tiny_llama, layout):
    from tests.workers.batches import portable, tensors

    world, tp, shared_prefix = LAYOUTS[layout]
    steps, ref_weights = _reference(tiny_llama, world // tp)
    res = tensors(run_ranks(_rank, world, args=(str(tiny_llama), tp, shared_prefix, portable(steps)), timeout_s=240))
    worst = 0.0
    for s, (got, want) in enumerate(zip(res[0], ref_weights)):
        w = got["weights"]
        assert set(w) == set(want), set(w) ^ set(want)
        for name, t in want.items():
            diff = float((w[name] - t).abs().max())
            worst = max(worst, diff)
            assert diff <= TOL, f"{layout}: step {s + 1}, {name} differs by {diff:.3g} (> {TOL})"
    moved = max(float((ref_weights[-1][n] - t).abs().max()) for n, t in ref_weights[0].items())
    assert moved > 100 * TOL, "the weights barely moved: agreement would prove nothing"
    print(f"{layout}: max |w_mrl - w_ref| over {STEPS} steps = {worst:.3g}; weights moved {moved:.3g} since step 1")
