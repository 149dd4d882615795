"""The quickstart's reward model, written locally with no download: ``python -m mrl.quickstarts rm --out outputs/quickstart``.

``<out>/tiny-rm/``: a ``Qwen2ForSequenceClassification`` (num_labels=1) for ``mrl_configs/quickstart_rm.yaml``,
trained here in a few CPU-seconds to prefer correct sums. It starts from the quickstart actor's
warm-started body (``<out>/tiny-qwen2``, written first by ``mrl.quickstarts.base`` when missing) with a
zero score head, and shares its tokenizer, so the RM reads the actor's token ids as they are. Training
has two phases on the 100 addition problems, with ``y = " <n></s>"`` as the actor answers and ``x`` the
prompt's ids exactly as the dataset encodes them:

1. the Bradley–Terry pairwise loss of RLHF reward models (Ouyang et al. 2022, "Training language
   models to follow instructions with human feedback", eq. 1)::

       L = -mean log σ(r(x, y_correct) - r(x, y_wrong))

   each pair drawing a problem and a wrong ``n`` in [0, 2·MAX_OPERAND) uniformly (seeded); AdamW (lr
   ``RM_LR``) on batches of ``RM_BATCH`` pairs until the pairwise accuracy over ALL 100 × 19
   (correct, wrong) pairs reaches ``RM_TARGET`` (checked every ``RM_CHECK`` steps) or ``RM_MAX_STEPS``;
2. a verifier (``train_rm_verifier``, ``LIST_STEPS`` steps): per problem, softmax cross-entropy over
   all candidate answers (the 2·MAX_OPERAND sums plus ``LIST_EXTRA`` out-of-range wrong ones,
   ``_extra_wrong``, and ``LIST_NOISE`` rule-wrong answers with arbitrary tokens, extra spaces or no
   EOS, ``_noisy_wrong``) with the right sum as the target, plus a binary cross-entropy on each candidate,
   so that σ(r) is the probability that the answer is right (Cobbe et al. 2021, "Training Verifiers
   to Solve Math Word Problems").

One thread: the bytes depend only on ``--seed``, the torch build and the CPU's floating-point order
(seed 0: 275 Bradley–Terry steps on an Intel AMX host, 100 on an AMD EPYC one on 2026-11-27, 275 on that
AMD host on 2026-11-28 from a fresh venv). Measured on the AMD host (seed 0, 2026-11-27): 100 Bradley–Terry
steps, then 300 verifier steps: **pairwise 1.000, top-1 1.00**, no wrong sum with σ > 0.5; on 2026-11-28:
275 + 300 steps, pairwise 0.999, top-1 0.99, 145 s of one core idle (150 verifier steps left 15 of the 1,900, and the policy found them);
with the verifier scoring each prompt once for its 48 candidates (``_scores_per_prompt``, 2026-11-28): the same
steps and accuracies in 97 s. Since 2026-12-05 the verifier step also splits the candidates into a short and a
long forward (fewer pad tokens) and remembers the answers' token ids: 300 verifier steps in 39-41 CPU-s instead of
51-54 on seeds 0-2, the same Bradley–Terry steps and accuracies (docs/reward_model.md).
The val set is the train set, so memorising the 100 problems is legitimate here. The Bradley–Terry RM
alone, or the verifier without the out-of-range or the noisy answers, did not teach the policy the task
(it collapsed onto a few favourite sums, or found answers like " 1111", " esti esti esti esti" or
"  9" the RM liked); docs/reward_model.md has the measurements.

The RM never sees the rule: the recipe's reward is its score alone (``reward_model.combine=function``
with :func:`score_with_acc`, which returns σ(RM score) as the reward and the ``arith`` rule's
verdict as the extra key ``acc``: validation reports it as ``val-core/arith/acc/mean@1``, so one
sees the policy learn the task from the RM).
"""
from __future__ import annotations

import random
import shutil
from pathlib import Path

from mrl.quickstarts.base import (
    MAX_OPERAND,
    MODEL_DIR,
    QWEN2_SHAPE,
    problems,
    write_assets,
)
from mrl.quickstarts.cli import Demo, UsageError

RM_DIR = "tiny-rm"
RM_LR, RM_BATCH, RM_MAX_STEPS, RM_TARGET, RM_CHECK = 1e-3, 64, 600, 0.97, 25
# Phase 2, a verifier: per problem, softmax cross-entropy over all 2·MAX_OPERAND candidate sums (listwise)
# plus a binary cross-entropy on each candidate (sigmoid(r) = P(correct)), LIST_BATCH problems a step,
# lr LIST_LR decayed linearly to 0 over LIST_STEPS: a constant lr, or phase 2 without phase 1, left top-1
# unsettled. LIST_STEPS is long enough that the RM accepts no wrong sum once the off-distribution negatives
# (LIST_NOISE) share the steps: a shorter phase left a few accepted and the policy collapsed onto them.
# The trials behind each choice: docs/reward_model.md ("What did not work").
LIST_LR, LIST_BATCH, LIST_STEPS = 5e-4, 16, 300
# ... and LIST_EXTRA out-of-range wrong answers per problem (``_extra_wrong``): without them the policy
# found answers the RM had never seen and liked (repeated digits, longer numbers).
LIST_EXTRA = 12
# ... and LIST_NOISE answers with tokens of the whole vocabulary in them (``_noisy_wrong``), kept only when the
# arith rule calls them wrong: without them the policy found answers with a stray non-digit token that the
# RM liked, and its greedy accuracy fell to 0.
LIST_NOISE = 16


def score_with_acc(solution_str: str, ground_truth: str, data_source: str | None = None,
                   extra_info: dict | None = None) -> dict:
    """reward.function of quickstart_rm.yaml: the reward is the RM's probability that the answer is right,
    ``sigmoid(rm_score)`` (the verifier head, module doc); ``acc`` = the arith rule (reported, never trained on)."""
    import math

    from mrl.rewards.scorers import arith

    if not extra_info or "rm_score" not in extra_info:
        raise ValueError("score_with_acc needs extra_info['rm_score']: enable reward_model (quickstart_rm.yaml)")
    r = float(extra_info["rm_score"])
    prob = 1.0 / (1.0 + math.exp(-r)) if r >= 0 else math.exp(r) / (1.0 + math.exp(r))  # no overflow
    return {"score": prob, "acc": float(arith(solution_str, ground_truth))}


def _encoded(tokenizer) -> list[tuple[list[int], int, list[list[int]]]]:
    """Per problem: prompt ids, the correct sum, and ``answer(n)`` ids for n in [0, 2·MAX_OPERAND)."""
    from mrl.data.tokenize import encode_prompt

    eos = QWEN2_SHAPE["eos_token_id"]
    answers = [tokenizer(f" {n}", add_special_tokens=False)["input_ids"] + [eos] for n in range(2 * MAX_OPERAND)]
    return [(encode_prompt(tokenizer, p), int(a), answers) for p, a in problems()]


def _extra_wrong(tokenizer, a: int, rng: random.Random) -> list[list[int]]:
    """Wrong answers outside the 2·MAX_OPERAND candidates: the empty answer, the right sum with more
    digits after it (" 71" for 7: 1-5 more), repeated digits (" 1111") and other numbers of 3-7 digits."""
    eos = QWEN2_SHAPE["eos_token_id"]
    texts = [" "]
    while len(texts) < LIST_EXTRA:
        k, kind = rng.randint(1, 5), len(texts) % 3
        digits = "".join(rng.choice("0123456789") for _ in range(k))
        texts.append(f" {a}{digits}" if kind == 0 else f" {str(rng.randint(1, 9)) * (k + 2)}" if kind == 1
                     else f" {rng.randint(1, 9)}{digits}{rng.randint(0, 9)}")
    return [tokenizer(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts]


def _noisy_wrong(tokenizer, a: int, rng: random.Random) -> list[list[int]]:
    """LIST_NOISE wrong answers with arbitrary tokens in them: a number in [0, 2·MAX_OPERAND) (the right
    sum included) spelt with 1-3 extra spaces before or after it (the policy found "  9" for 11, σ = 0.98),
    or with 1-3 tokens drawn from the whole vocabulary (specials excepted) inserted anywhere,
    1-6 such tokens alone, or one token repeated 2-8 times; half end with EOS, half stop without it (a
    response cut at rollout.max_response_length: the RM then reads a token it never saw last, and the
    policy found " esti esti esti esti", σ = 0.46 where wrong sums get 0.01). Each is kept only when the
    ``arith`` rule calls it wrong (e.g. " 1\x0c 12" for 18; " 7\x0c" for 7 is right by the rule and is redrawn)."""
    from mrl.rewards.scorers import arith

    eos, first = QWEN2_SHAPE["eos_token_id"], QWEN2_SHAPE["eos_token_id"] + 1  # ids 0-2: pad, bos, eos
    out: list[list[int]] = []
    while len(out) < LIST_NOISE:
        k, kind = rng.randint(1, 3), rng.random()
        if kind < 0.35:  # a number spelt with extra spaces ("  9", " 9  ")
            n = rng.randrange(2 * MAX_OPERAND)
            ids = tokenizer(" " * k + f" {n}" if rng.random() < 0.7 else f" {n}" + " " * k,
                            add_special_tokens=False)["input_ids"]
        elif kind < 0.65:
            ids = tokenizer(f" {rng.randrange(2 * MAX_OPERAND)}", add_special_tokens=False)["input_ids"]
            for _ in range(k):
                ids.insert(rng.randint(0, len(ids)), rng.randrange(first, tokenizer.vocab_size))
        elif kind < 0.8:
            ids = [rng.randrange(first, tokenizer.vocab_size) for _ in range(2 * k)]
        else:
            ids = [rng.randrange(first, tokenizer.vocab_size)] * rng.randint(2, 8)
        if not arith(tokenizer.decode(ids), str(a)):
            out.append(ids + [eos] if len(out) % 2 == 0 else ids)
    return out


class _Remembering:
    """The tokenizer calls of ``_extra_wrong`` / ``_noisy_wrong`` (``tok(text, add_special_tokens=False)``,
    ``decode``, ``vocab_size``), each text's ids and each id list's text remembered: the same ids and texts,
    a tenth of the verifier step's time saved (measured 2026-12-05)."""

    def __init__(self, tokenizer):
        self._tok, self.vocab_size = tokenizer, tokenizer.vocab_size
        self._ids: dict[str, tuple[int, ...]] = {}
        self._texts: dict[tuple[int, ...], str] = {}

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        if add_special_tokens:
            raise ValueError("_Remembering encodes without special tokens only")
        if text not in self._ids:
            self._ids[text] = tuple(self._tok(text, add_special_tokens=False)["input_ids"])
        return {"input_ids": list(self._ids[text])}  # a new list: _noisy_wrong inserts into it

    def decode(self, ids: list[int]) -> str:
        key = tuple(ids)
        if key not in self._texts:
            self._texts[key] = self._tok.decode(ids)
        return self._texts[key]


def _scores(model, seqs: list[list[int]], **kwargs):
    import torch

    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # right-padded with <pad>=0
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    return model(input_ids=ids, **kwargs).logits[:, 0]  # HF reads the last non-pad token


def _scores_per_prompt(model, prompts: list[list[int]], candidates: list[list[list[int]]]):
    """[P, C] scores of ``prompts[i] + candidates[i][j]``: each prompt's keys and values are computed once per
    forward and repeated for its candidates, as an engine's prefix cache does, instead of C times (the
    verifier's 16 prompts of 12 tokens with 48 candidates of 2-9: 2x fewer FLOPs and 2.0x faster a step than
    scoring the 768 whole sequences, on the project's 2-core host; the scores agree to fp32 rounding). The
    candidates go in two forwards by length (below), each row's score put back at its (i, j)."""
    import inspect

    import torch

    if len({len(p) for p in prompts}) != 1 or len({len(c) for c in candidates}) != 1:
        raise ValueError("_scores_per_prompt needs prompts of one length and the same number of candidates each")
    # transformers 5.x names the cache argument and output `cache` (`past_key_values`, before, warns there)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    C = len(candidates[0])
    flat = [c for cands in candidates for c in cands]
    # Two forwards, the shorter candidates and the longer ones, split where the fewest pad tokens are scored:
    # the verifier's candidates are 2-9 tokens (mean 4.8), so padding all of them to the longest would spend
    # half the candidate tokens on pads. One forward per length saves more pads but costs more in per-call
    # overhead at this size (verifier step, 2-core host, 2026-12-05: one forward 179 ms, one per length 168,
    # two 136-143).
    lengths = sorted({len(c) for c in flat})
    def padded(split: int) -> int:
        short = [len(c) for c in flat if len(c) <= split]
        return len(short) * split + (len(flat) - len(short)) * lengths[-1]
    split = min(lengths, key=padded)
    groups = [[r for r, c in enumerate(flat) if len(c) <= split], [r for r, c in enumerate(flat) if len(c) > split]]
    rows, scores = [], []
    for idx in groups:
        if not idx:
            continue
        cache = getattr(model.model(input_ids=torch.tensor(prompts), use_cache=True), name)
        cache.batch_select_indices(torch.tensor([r // C for r in idx]))  # each row's prompt keys/values
        scores.append(_scores(model, [flat[r] for r in idx], **{name: cache}))
        rows += idx
    order = torch.empty(len(flat), dtype=torch.long)
    order[torch.tensor(rows)] = torch.arange(len(flat))  # row r's score is at order[r] of the concatenation
    return torch.cat(scores)[order].view(len(prompts), C)


def rm_accuracy(model, tokenizer) -> tuple[float, float]:
    """(pairwise, top-1): the fraction of all (problem, wrong n) pairs the RM orders right, and of
    problems whose correct sum it scores above EVERY wrong one (what a policy maximising the RM sees)."""
    import torch

    wins = total = top1 = 0
    with torch.no_grad():
        for p, a, answers in _encoded(tokenizer):
            s = _scores(model, [p + ans for ans in answers])
            wrong = torch.cat([s[:a], s[a + 1:]])
            wins += int((s[a] > wrong).sum())
            total += wrong.numel()
            top1 += int(bool((s[a] > wrong).all()))
    return wins / total, top1 / len(problems())


def train_rm(model, tokenizer, seed: int, max_steps: int = RM_MAX_STEPS) -> tuple[int, float]:
    """Bradley–Terry training in place (module doc); returns (steps, pairwise accuracy)."""
    import torch

    rng, data = random.Random(seed), _encoded(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=RM_LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    step, acc = 0, 0.0
    try:
        while step < max_steps and acc < RM_TARGET:
            model.train()
            for _ in range(min(RM_CHECK, max_steps - step)):
                chosen, rejected = [], []
                for p, a, answers in (rng.choice(data) for _ in range(RM_BATCH)):
                    wrong = rng.choice([n for n in range(len(answers)) if n != a])
                    chosen.append(p + answers[a])
                    rejected.append(p + answers[wrong])
                s = _scores(model, chosen + rejected)
                loss = -torch.nn.functional.logsigmoid(s[:RM_BATCH] - s[RM_BATCH:]).mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
            model.eval()
            acc = rm_accuracy(model, tokenizer)[0]
    finally:
        torch.set_num_threads(threads)
    return step, acc


def train_rm_verifier(model, tokenizer, seed: int, steps: int = LIST_STEPS) -> None:
    """Phase 2 in place (module doc): listwise + pointwise loss over all candidates of a problem."""
    import torch
    import torch.nn.functional as F

    rng, data = random.Random(seed + 1), _encoded(tokenizer)
    tokenizer = _Remembering(tokenizer)  # the same few thousand answers are encoded and decoded every step
    opt = torch.optim.AdamW(model.parameters(), lr=LIST_LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model.train()
    try:
        for step in range(steps):
            batch = [rng.choice(data) for _ in range(LIST_BATCH)]
            s = _scores_per_prompt(model, [p for p, _, _ in batch],
                                   [answers + _extra_wrong(tokenizer, a, rng) + _noisy_wrong(tokenizer, a, rng)
                                    for _, a, answers in batch])
            target = torch.tensor([a for _, a, _ in batch])
            loss = F.cross_entropy(s, target) + F.binary_cross_entropy_with_logits(
                s, F.one_hot(target, s.shape[1]).float())
            for group in opt.param_groups:
                group["lr"] = LIST_LR * (1 - step / steps)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    finally:
        model.eval()
        torch.set_num_threads(threads)


def write_rm(out: str | Path, *, seed: int = 0, force: bool = False,
             max_steps: int = RM_MAX_STEPS, list_steps: int = LIST_STEPS) -> dict[str, str]:
    """Write ``<out>/tiny-rm`` (and the quickstart's assets it starts from, when missing); returns
    {asset: 'written (...)' | 'kept'}."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = Path(out)
    status = write_assets(out, seed=seed)  # the actor model and data (kept when present)
    lm_dir, rm_dir = out / MODEL_DIR, out / RM_DIR
    if not force and (rm_dir / "config.json").is_file() and (rm_dir / "model.safetensors").is_file():
        status[str(rm_dir)] = "kept"
        return status
    shutil.rmtree(rm_dir, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(lm_dir))
    torch.manual_seed(seed)
    rm = AutoModelForSequenceClassification.from_pretrained(str(lm_dir), num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.zero_()  # no preference before training: every score 0
    rm.config.pad_token_id = QWEN2_SHAPE["pad_token_id"]
    steps, _ = train_rm(rm, tok, seed, max_steps)
    train_rm_verifier(rm, tok, seed, list_steps)
    pairwise, top1 = rm_accuracy(rm, tok)
    rm.save_pretrained(str(rm_dir), safe_serialization=True)
    tok.save_pretrained(str(rm_dir))
    status[str(rm_dir)] = (f"written (Bradley-Terry: {steps} steps, verifier: {list_steps} steps; "
                           f"pairwise accuracy {pairwise:.3f}, top-1 {top1:.2f})")
    return status


def _add_arguments(p) -> None:
    p.add_argument("--max-steps", type=int, default=RM_MAX_STEPS,
                   help=f"most training steps; it stops once the pairwise accuracy reaches {RM_TARGET}")
    p.add_argument("--verifier-steps", type=int, default=LIST_STEPS,
                   help=f"steps of phase 2, the listwise + pointwise verifier loss (default {LIST_STEPS}; 0: none)")


def _write(args) -> dict[str, str]:
    if args.max_steps < 1:
        raise UsageError("--max-steps must be >= 1")
    if args.verifier_steps < 0:
        raise UsageError("--verifier-steps must be >= 0")
    return write_rm(args.out, seed=args.seed, force=args.force, max_steps=args.max_steps,
                    list_steps=args.verifier_steps)


DEMO = Demo("rm", "the quickstart's reward model (a Qwen2 classifier on the actor's body)", "outputs/quickstart", 0, _add_arguments, _write)
