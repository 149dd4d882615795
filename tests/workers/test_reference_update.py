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

Weights after Adam with an active global-norm clip cannot see a constant gradient scale (both divide it
out: the reference with its loss × 0.5, × 2 and × 4 still matched them to ≤ 2.5e-6), so a 2× bug —
summing instead of averaging over DP ranks, a wrong token-mean denominator — would pass them. Three
checks see the scale:

* the pre-clip global gradient norm of every optimizer step: mrl's ``actor/grad_norm`` (the mean over
  the update's two optimizer steps) against the mean of the reference's ``clip_grad_norm_`` returns;
* step 1's per-parameter gradients (both mini-batches, DP-reduced, before the clip): Megatron's
  ``main_grad`` under HF names, all-gathered over the distributed optimizer's shards and over TP;
* a plain-SGD run (step 1's batch, two optimizer steps), whose weights are linear in the gradient. mrl's
  optimizer is Megatron's Adam only, so SGD is Adam with betas (0, 0) — no state: m̂ = g, v̂ = g² — and
  ε = ``SGD_EPS`` = 1e6 ≫ |g| (the whole gradient's norm is ~4.5 here): its step ``lr·g/(|g| + ε)`` is
  ``(lr/ε)·g`` to a relative |g|/ε < 5e-6, and the reference is ``torch.optim.SGD`` at lr/ε. No weight decay
  (decoupled, it would be scaled by lr = 1e4), and a clip threshold far above the norm: a clip that acts
  would divide the scale out again, and clip 0 would stop Megatron computing the norm. The step moves
  weights by up to ~6e-3, so a gradient off by more than ~0.2 % shows in them.

Seen failing (faults injected in a copy of the tree): the actor loss × 2 (every layout) and the loss scale
without its DP factor (``n_mb·D`` → ``n_mb``, dp2) turn all three red, while the weights after 20 Adam
steps stay within 2.7e-6 of the reference's, as they did before these checks.
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
SGD_LR, SGD_EPS, SGD_CLIP = 1e-2, 1e6, 1e6  # the SGD run: w <- w - SGD_LR·g, the clip never acts
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
    """Plain PyTorch GRPO: the HF model, torch.optim.AdamW (or torch.optim.SGD), clip_grad_norm_."""

    def __init__(self, model, dp: int, sgd: bool = False) -> None:
        # transformers builds the embedding with padding_idx = pad_token_id, which zeroes that row's
        # gradient wherever the token occurs; here the policy can sample it inside a response (step 1
        # does), where it is an input like any other. The objective's gradient includes that row, and
        # Megatron (mrl) computes it: the reference follows the formula, not the HF convention.
        model.get_input_embeddings().padding_idx = None
        self.model, self.dp = model, dp
        if sgd:
            self.opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
            self.max_norm = SGD_CLIP
        else:
            decay = [p for n, p in model.named_parameters() if p.dim() > 1 and not n.endswith(".bias")]
            no_decay = [p for n, p in model.named_parameters() if not (p.dim() > 1 and not n.endswith(".bias"))]
            self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                          {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.999),
                                         eps=1e-8)
            self.max_norm = CLIP_GRAD
        self.clipped = 0  # optimizer steps whose gradient norm exceeded max_norm
        self.norms: list[list[float]] = []  # per step(): the pre-clip global norm of each optimizer step
        self.grads: list[dict[str, torch.Tensor]] = []  # the first step()'s pre-clip gradients, per optimizer step

    def step(self, data: dict) -> None:
        adv = _grpo_advantages(data["rewards"])
        with torch.no_grad():
            old = [_seq_log_probs(self.model, p, r) for p, r in zip(data["prompts"], data["responses"])]
        norms = []
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
            if not self.norms:
                self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters()})
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
            self.clipped += int(norm > self.max_norm)
            norms.append(float(norm))
            self.opt.step()
        self.norms.append(norms)


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


def _grads_by_hf_name(actor) -> dict[str, torch.Tensor]:
    """The DP-reduced gradient of the step about to be taken (``main_grad``), under HF names; collective
    over DP and TP. With the distributed optimizer, Megatron reduce-scatters each grad bucket: a DP
    rank holds the reduced values of its own shard only, so the shards are all-gathered first (in place,
    before the optimizer step: it reads only this rank's shard, which the gather leaves as it was)."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    from tests.workers.test_layout_invariance import (
        _grads_by_hf_name as main_grads_by_hf_name,
    )

    for c in actor.model.chunks:
        for group in c.bucket_groups + c.expert_parallel_bucket_groups:
            size = group.intra_distributed_optimizer_instance_size
            if not group.ddp_config.use_distributed_optimizer or size == 1:
                continue
            for bucket in group.buckets:
                mine = shard_buffer(bucket.grad_data, size)[group.intra_distributed_optimizer_instance_rank].clone()
                dist.all_gather_into_tensor(bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group)
    return main_grads_by_hf_name(actor)  # main_grad swapped into p.data, TP-gathered under HF names


def _run_actor(path, tp, shared_prefix, steps, optim: dict, keep: bool, grads_of_step_1: bool) -> list[dict]:
    from mrl.algorithms.advantages import get_adv_estimator
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import tensors

    cfg = ActorConfig(
        megatron={"tensor_model_parallel_size": tp}, ppo_mini_batch_size=PROMPTS // 2, shared_prefix=shared_prefix,
        ppo_micro_batch_size_per_gpu=MICRO, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C,
        optim=optim,
    )
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=PROMPTS // 2 * N, temperature=TEMPERATURE,
                        seed=1234)
    grpo = get_adv_estimator("grpo")
    out = []
    for s, data in enumerate(tensors(steps)):
        batch, scores = _train_batch(data)
        lp, _ = actor.compute_log_prob(batch)
        adv, _ = grpo(scores, batch.response_mask.float(), index=batch.uid)
        grads = []
        if grads_of_step_1 and s == 0:  # each optimizer step's gradient, read just before the step
            def step_after_reading_grads(metrics, acc, _step=actor.optimizer_step, _grads=grads):
                _grads.append(_grads_by_hf_name(actor))
                _step(metrics, acc)

            actor.optimizer_step = step_after_reading_grads
        metrics = actor.update_policy(batch.replace(old_log_probs=lp, advantages=adv))
        actor.__dict__.pop("optimizer_step", None)
        weights = {n: t.clone() for n, t in actor.export_hf_weights()}  # collective over TP
        out.append({"weights": weights if keep else None, "grads": grads if keep else None,
                    "grad_norm": metrics["actor/grad_norm"]})
    return out


def _rank(rank, world, path, tp, shared_prefix, steps):
    from megatron.core import parallel_state as ps

    from tests.workers.batches import portable

    keep = rank == 0
    adam = _run_actor(path, tp, shared_prefix, steps, {"lr": LR, "weight_decay": WEIGHT_DECAY, "clip_grad": CLIP_GRAD},
                      keep, grads_of_step_1=True)
    assert ps.get_data_parallel_world_size() == world // tp
    sgd = _run_actor(path, tp, shared_prefix, steps[:1],
                     {"lr": SGD_LR * SGD_EPS, "eps": SGD_EPS, "betas": (0.0, 0.0), "weight_decay": 0.0,
                      "clip_grad": SGD_CLIP}, keep, grads_of_step_1=False)
    return portable({"adam": adam, "sgd": sgd})


_REFERENCE: dict[tuple[int, bool], dict] = {}  # (dp, sgd) -> the reference's run


def _reference(path, dp: int, sgd: bool = False) -> dict:
    if (dp, sgd) not in _REFERENCE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # ~1000 tiny forwards: 3 ms each on one thread, ~40 ms on two busy cores
        try:
            _REFERENCE[dp, sgd] = _run_reference(path, dp, sgd)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCE[dp, sgd]


def _run_reference(path, dp: int, sgd: bool) -> dict:
    """The steps' samples, the reference's weights after each step, its pre-clip gradient norms (per step,
    per optimizer step) and step 1's pre-clip gradients (per optimizer step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ref = Reference(model, dp, sgd=sgd)
    steps, weights = [], [{n: t.detach().clone() for n, t in model.state_dict().items()}]
    for s in range(1 if sgd else STEPS):
        data = _sample_step(model, s)  # SGD's: the Adam run's step 1 (the same initial policy and generator)
        ref.step(data)
        steps.append(data)
        weights.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    if sgd:
        assert ref.clipped == 0, "the clip acted in the SGD run: it would divide the gradient's scale out"
    else:
        assert ref.clipped > 0, "grad clipping never acted: the test would not exercise it"
    return {"steps": steps, "initial": weights[0], "weights": weights[1:], "norms": ref.norms, "grads": ref.grads}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("ref_update") / "llama", "llama")


def _assert_weights(layout: str, run: str, got: list[dict], want: list[dict]) -> float:
    """mrl's HF-named weights after each step = the reference's, to TOL (absolute)."""
    worst = 0.0
    for s, (g, w) in enumerate(zip(got, want, strict=True)):
        g = g["weights"]
        assert set(g) == set(w), set(g) ^ set(w)
        for name, t in w.items():
            diff = float((g[name] - t).abs().max())
            worst = max(worst, diff)
            assert diff <= TOL, f"{layout} {run}: step {s + 1}, {name} differs by {diff:.3g} (> {TOL})"
    return worst


def _assert_grad_norms(layout: str, run: str, got: list[dict], want: list[list[float]]) -> float:
    """actor/grad_norm (mean over the update's optimizer steps) = the reference's pre-clip norms' mean."""
    worst = 0.0
    for s, (g, norms) in enumerate(zip(got, want, strict=True)):
        ref = sum(norms) / len(norms)
        rel = abs(g["grad_norm"] - ref) / ref
        worst = max(worst, rel)
        assert rel <= TOL, (f"{layout} {run}: step {s + 1}, actor/grad_norm {g['grad_norm']:.7g} vs the reference's "
                            f"{ref:.7g} (relative {rel:.3g} > {TOL})")
    return worst


def _assert_step1_grads(layout: str, got: list[dict], want: list[dict]) -> float:
    """Step 1's gradient of each optimizer step, parameter by parameter, relative to each tensor's largest entry."""
    worst = 0.0
    assert len(got) == len(want) == 2, (len(got), len(want))
    for k, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), set(g) ^ set(w)
        for name, g_ref in w.items():
            scale = float(g_ref.abs().max())
            assert scale > 0, f"{name}: no gradient in optimizer step {k + 1}"
            rel = float((g[name] - g_ref).abs().max()) / scale
            worst = max(worst, rel)
            assert rel <= TOL, (f"{layout}: step 1, optimizer step {k + 1}, {name}: gradient differs by {rel:.3g} "
                                f"of its largest entry (> {TOL})")
    return worst


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grpo_updates_equal_plain_pytorch_reference(tiny_llama, layout):
    from tests.workers.batches import portable, tensors

    world, tp, shared_prefix = LAYOUTS[layout]
    adam, sgd = _reference(tiny_llama, world // tp), _reference(tiny_llama, world // tp, sgd=True)
    assert all(torch.equal(a, b) for k in ("prompts", "responses") for a, b in zip(adam["steps"][0][k], sgd["steps"][0][k])
               ), "the SGD run's batch is not the Adam run's step 1 (mrl's SGD run is given that one)"
    res = tensors(run_ranks(_rank, world, args=(str(tiny_llama), tp, shared_prefix, portable(adam["steps"])),
                            timeout_s=240))[0]  # rank 0's
    # the gradient's scale: the pre-clip norms, then step 1's gradients; then the weights
    worst = {"grad_norm": _assert_grad_norms(layout, "adam", res["adam"], adam["norms"]),
             "sgd_grad_norm": _assert_grad_norms(layout, "sgd", res["sgd"], sgd["norms"]),
             "grad": _assert_step1_grads(layout, res["adam"][0]["grads"], adam["grads"])}
    worst["adam_weights"] = _assert_weights(layout, "adam", res["adam"], adam["weights"])
    worst["sgd_weights"] = _assert_weights(layout, "sgd", res["sgd"], sgd["weights"])
    moved = max(float((adam["weights"][-1][n] - t).abs().max()) for n, t in adam["weights"][0].items())
    assert moved > 100 * TOL, "the weights barely moved: agreement would prove nothing"
    # SGD moves each weight by SGD_LR·g: a gradient off by a factor (1 + δ) moves it δ·moved_sgd further
    moved_sgd = max(float((sgd["weights"][0][n] - t).abs().max()) for n, t in sgd["initial"].items())
    assert moved_sgd > 100 * TOL, f"SGD's first step moved the weights by {moved_sgd:.3g} only"
    print(f"{layout}: max deviations {worst}; Adam moved the weights {moved:.3g} after step 1, SGD's step 1 moved "
          f"them {moved_sgd:.3g}")
