"""The judge quickstart's judge, written locally with no download: ``python -m mrl.quickstarts judge --out outputs/quickstart``.

``<out>/tiny-judge/``: a tiny causal LM (the quickstart actor's warm-started Qwen2 body and tokenizer,
fine-tuned here) that answers " yes" or " no" to the judge prompt of ``mrl_configs/quickstart_judge.yaml``:

    TEMPLATE.format(prompt="question: what is 3 + 4 ? answer:", response=" 7")
      = "question: what is 3 + 4 ? answer: 7 ? verdict:"   ->  " yes</s>"   (" 8", " 77", " " -> " no</s>")

It never sees the ground truth (the template has no {ground_truth}): it has learnt which sums are
right. Training (``train_judge``): AdamW (lr ``JUDGE_LR``, decayed linearly to 0) on batches of
``JUDGE_BATCH`` judge prompts, half with the right sum and half with a wrong answer; the loss is the
next-token cross-entropy of the verdict tokens " yes</s>" / " no</s>" (and, on a right row, of everything
from the answer on: see below), until the verdict accuracy
(:func:`judge_accuracy`: every problem's right sum and all its wrong sums in [0, 2·MAX_OPERAND) plus
``N_EXTRA`` out-of-range ones, read where " yes" and " no" first differ) reaches ``JUDGE_TARGET``
(checked every ``JUDGE_CHECK`` steps) or ``--max-steps``. A wrong answer is drawn from three sources:

* hard negatives: with probability ``HARD_FRAC``, one of the wrong answers the judge accepted at the last
  check (the accuracy set and the policy's answers below). Only wrong rows are mined: mining the right
  ones too made the accuracies swing between checks (docs/judge.md);
* the policy's own wrong answers: with probability ``POLICY_FRAC``, one of ``POLICY_SAMPLES`` answers
  per problem sampled (temperature 1, as the rollout) from the warm-started actor, that the ``arith``
  rule scores 0 -- what the RL policy will actually send the judge at step 1;
* otherwise a synthetic one: a near miss s±1..3, any n < 4·MAX_OPERAND, or an out-of-range one like
  the RM's (" ", " 71", " 1111").

A right row's loss also covers its answer tokens: the judge's copy of the body keeps learning
to add. This is what takes asset seeds 1 and 2 to the target: with uniform wrong answers only, their judges
still said " yes" to 16 % / 42 % of the wrong sums after 1500 steps and were gamed; hard negatives alone did
not fix it; the sum alone did (1200-1300 steps), and all three together take seeds 0-2 there in 1100
(docs/judge.md, *Judge asset steps*). Since the loss computes logits only where it reads them and the checks
score against each prompt's cached keys and values (2026-12-05; the same recipe in another float order):
1000 / 1100 / 800 steps, 7-40 % fewer CPU-seconds (docs/judge.md, *Judge asset CPU time*).

A judge still below the target after ``--max-steps`` is not written (a policy trained on it games it:
docs/judge.md): the script exits 1 with one line naming the seed, the accuracies and the fix, unless
``--allow-below-target`` writes it with a WARNING.

One thread: the bytes depend only on ``--seed`` (and the torch build).
"""
from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

from mrl.quickstarts.base import (
    MAX_OPERAND,
    MODEL_DIR,
    QWEN2_SHAPE,
    problems,
    write_assets,
)
from mrl.quickstarts.cli import Demo, DemoFailed, UsageError

JUDGE_DIR = "tiny-judge"
TEMPLATE = "{prompt}{response} ? verdict:"  # = reward.judge.prompt_template of quickstart_judge.yaml (a test checks)
YES, NO = " yes", " no"
JUDGE_LR, JUDGE_BATCH, JUDGE_MAX_STEPS, JUDGE_TARGET, JUDGE_CHECK = 2e-3, 64, 1500, 0.995, 100
N_EXTRA = 8
HARD_FRAC, POLICY_FRAC, POLICY_SAMPLES, POLICY_MAX_TOKENS = 0.25, 0.25, 8, 8  # module doc; 8 = the recipe's max_response_length


def _wrong(a: int, rng: random.Random) -> str:
    """One wrong answer to a problem whose sum is ``a`` (module doc)."""
    kind = rng.random()
    if kind < 0.4:
        n = a + rng.choice([-3, -2, -1, 1, 2, 3])
        return f" {n if n >= 0 else a + 4}"
    if kind < 0.75:
        return f" {rng.choice([n for n in range(4 * MAX_OPERAND) if n != a])}"
    return _extra(a, rng)


def _extra(a: int, rng: random.Random) -> str:
    """An out-of-range wrong answer: empty, the sum with digits after it, repeated digits, or the sum twice."""
    k, kind = rng.randint(1, 4), rng.randint(0, 4)
    digits = "".join(rng.choice("0123456789") for _ in range(k))
    return [" ", f" {a}{digits}", f" {str(rng.randint(1, 9)) * (k + 1)}", f" {a} {a}", f" {rng.randint(1, 9)}{digits}"][kind]


def _verdict_ids(tok) -> tuple[list[int], list[int], int]:
    """Token ids of " yes</s>", " no</s>" and the index where they first differ."""
    eos = QWEN2_SHAPE["eos_token_id"]
    y, n = tok.encode(YES, add_special_tokens=False) + [eos], tok.encode(NO, add_special_tokens=False) + [eos]
    k = next(i for i in range(min(len(y), len(n))) if y[i] != n[i])
    return y, n, k


def _batch(seqs: list[list[int]]):
    import torch

    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # right-padded with <pad>=0
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    return ids


def _encoder(tok):
    """``tok.encode(text, add_special_tokens=False)``, remembered per text: the training steps and the checks
    encode the same few thousand judge prompts over and over (a tenth of the recipe's time, measured
    2026-11-28; the ids, and so the written judge, are the same)."""
    import functools

    @functools.cache
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    return lambda text: list(ids(text))


def _verdicts(model, tok, cases: list[tuple[str, str, bool]], encode=None) -> list[bool]:
    """Whether the judge says " yes" to each (prompt, response, right) case, read at the token where
    " yes" and " no" first differ (greedy decoding picks the same). ``encode``: :func:`_encoder`'s, to reuse."""
    return (_margins(model, tok, cases, encode) > 0).tolist()


def _margins(model, tok, cases: list[tuple[str, str, bool]], encode=None):
    """logit(" yes") - logit(" no") of each case at the token where they first differ, [len(cases)].

    A case whose ids start with its prompt's ids (every one of this task's: the responses start with a space)
    is scored against its prompt's keys and values, computed once per chunk for the chunk's prompts, as an
    engine's prefix cache does: the accuracy set's 28 cases a problem share a 12-token prompt of their ~26
    tokens. Any other case (a prompt of another length, a response merged into the prompt's last token) is
    scored whole. Either way the same logits, to fp32 rounding."""
    import inspect

    import torch

    encode = encode or _encoder(tok)
    y, n, k = _verdict_ids(tok)
    seqs = [encode(TEMPLATE.format(prompt=p, response=c)) + y[:k] for p, c, _ in cases]
    heads = [encode(p) for p, _, _ in cases]
    P = len(heads[0]) if heads else 0
    shared = [i for i, (s, h) in enumerate(zip(seqs, heads, strict=True)) if len(h) == P and len(s) > P and s[:P] == h]
    alone = sorted(set(range(len(cases))) - set(shared))
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    out = torch.empty(len(cases))
    with torch.inference_mode():
        for i in range(0, len(shared), 512):
            chunk = shared[i:i + 512]
            prompts = sorted({tuple(heads[j]) for j in chunk})
            at = {h: t for t, h in enumerate(prompts)}
            cache = getattr(model.model(input_ids=torch.tensor(prompts), use_cache=True), name)
            cache.batch_select_indices(torch.tensor([at[tuple(heads[j])] for j in chunk]))  # each row's prompt
            tails = [seqs[j][P:] for j in chunk]
            hidden = model.model(input_ids=_batch(tails), **{name: cache}).last_hidden_state
            out[chunk] = _margin(model, hidden, tails, y[k], n[k])
        for i in range(0, len(alone), 256):
            chunk = alone[i:i + 256]
            whole = [seqs[j] for j in chunk]
            out[chunk] = _margin(model, model.model(input_ids=_batch(whole)).last_hidden_state, whole, y[k], n[k])
    return out


def _margin(model, hidden, seqs: list[list[int]], yes: int, no: int):
    """logit(yes) - logit(no) at each right-padded row's last token: the LM head at that position only."""
    import torch

    logits = model.lm_head(hidden[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])])
    return logits[:, yes] - logits[:, no]


def accuracy_set(seed: int = 0) -> list[tuple[str, str, bool]]:
    """(prompt, response, right) over every problem's right sum, all its wrong sums in [0, 2·MAX_OPERAND)
    and ``N_EXTRA`` out-of-range answers."""
    rng = random.Random(seed + 7)
    cases = []
    for p, ans in problems():
        a = int(ans)
        cands = [f" {m}" for m in range(2 * MAX_OPERAND)] + [_extra(a, rng) for _ in range(N_EXTRA)]
        cases += [(p, c, c == f" {a}") for c in cands]
    return cases


def _rates(cases: list[tuple[str, str, bool]], says: list[bool]) -> tuple[float, float]:
    """(share of right cases said " yes", share of wrong ones said " no"); nan for an empty class."""
    good = [v for (_, _, r), v in zip(cases, says, strict=True) if r]
    bad = [not v for (_, _, r), v in zip(cases, says, strict=True) if not r]
    return (sum(good) / len(good) if good else float("nan")), (sum(bad) / len(bad) if bad else float("nan"))


def judge_accuracy(model, tok, seed: int = 0) -> tuple[float, float]:
    """(accuracy on right answers, accuracy on wrong ones) over :func:`accuracy_set`."""
    cases = accuracy_set(seed)
    return _rates(cases, _verdicts(model, tok, cases))


def policy_negatives(model, tok, seed: int, samples: int = POLICY_SAMPLES) -> list[tuple[str, str, bool]]:
    """The warm-started policy's own wrong answers: ``samples`` answers per problem sampled at temperature 1
    (as the rollout does) that the ``arith`` rule scores 0, as (prompt, response, False); duplicates kept
    (a frequent answer is drawn more often). Seeded; call on one thread for the same bytes."""
    import torch

    from mrl.data.tokenize import left_pad
    from mrl.quickstarts.base import QWEN2_SHAPE as shape
    from mrl.rewards.scorers import arith

    rows = problems()
    ids, mask = left_pad([tok.encode(p, add_special_tokens=False) for p, _ in rows], shape["pad_token_id"])  # as the engine sees prompts
    P = ids.shape[1]
    gen = torch.Generator().manual_seed(seed + 11)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))  # generate() samples from the global RNG
    with torch.no_grad():
        out = model.generate(input_ids=ids.repeat_interleave(samples, 0), attention_mask=mask.repeat_interleave(samples, 0),
                             max_new_tokens=POLICY_MAX_TOKENS, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             pad_token_id=shape["pad_token_id"], eos_token_id=shape["eos_token_id"])
    answers = tok.batch_decode(out[:, P:], skip_special_tokens=True)
    cases = []
    for j, r in enumerate(answers):
        p, a = rows[j // samples]
        if not arith(r, a):
            cases.append((p, r, False))
    return cases


def train_judge(model, tok, seed: int, max_steps: int = JUDGE_MAX_STEPS, progress=None) -> tuple[int, tuple[float, float, float]]:
    """Verdict fine-tuning in place (module doc); returns (steps, (accuracy on right answers, on wrong ones,
    on the warm-started policy's wrong samples))."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(seed)
    encode = _encoder(tok)
    y, n, _ = _verdict_ids(tok)
    rows = [(p, int(a)) for p, a in problems()]
    opt = torch.optim.AdamW(model.parameters(), lr=JUDGE_LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    step, acc = 0, (0.0, 0.0, 0.0)
    try:
        model.eval()
        policy = policy_negatives(model, tok, seed)  # before any judge step: the RL policy's start
        cases = accuracy_set(seed) + policy
        hard: list[tuple[str, str, bool]] = []  # the wrong answers the judge accepted at the last check
        while step < max_steps and min(acc[:2]) < JUDGE_TARGET:
            model.train()
            for _ in range(min(JUDGE_CHECK, max_steps - step)):
                seqs, starts = [], []
                for i in range(JUDGE_BATCH):
                    good = i % 2 == 0
                    if not good and hard and rng.random() < HARD_FRAC:
                        p, response, _ = rng.choice(hard)
                    elif not good and policy and rng.random() < POLICY_FRAC:
                        p, response, _ = rng.choice(policy)
                    else:
                        p, a = rng.choice(rows)
                        response = f" {a}" if good else _wrong(a, rng)
                    prompt = encode(TEMPLATE.format(prompt=p, response=response))
                    seqs.append(prompt + (y if good else n))
                    # a right row also teaches the sum itself (its answer tokens): the judge learns to add
                    starts.append(len(encode(p)) if good else len(prompt))
                ids = _batch(seqs)
                target = torch.zeros_like(ids, dtype=torch.bool)
                for i, (s, k) in enumerate(zip(seqs, starts, strict=True)):
                    target[i, k:len(s)] = True
                # logits only where the loss reads them (a third of the positions): the LM head and its
                # softmax over the vocabulary skip the rest, the loss is the same
                hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
                loss = F.cross_entropy(model.lm_head(hidden[target[:, 1:]]), ids[:, 1:][target[:, 1:]])
                for group in opt.param_groups:
                    group["lr"] = JUDGE_LR * (1 - step / max_steps)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
            model.eval()
            says = _verdicts(model, tok, cases, encode)
            hard = [c for c, v in zip(cases, says, strict=True) if not c[2] and v]
            n_set = len(cases) - len(policy)
            acc = (*_rates(cases[:n_set], says[:n_set]), _rates(policy, says[n_set:])[1])
            if progress is not None:
                progress(step, acc)
    finally:
        model.eval()
        torch.set_num_threads(threads)
    return step, acc


def write_judge(out: str | Path, *, seed: int = 0, force: bool = False, max_steps: int = JUDGE_MAX_STEPS,
                allow_below_target: bool = False) -> dict[str, str]:
    """Write ``<out>/tiny-judge`` (and the quickstart's assets it starts from, when missing). A judge below
    ``JUDGE_TARGET`` after ``max_steps`` raises :class:`DemoFailed` and is not written, unless
    ``allow_below_target`` (then its status carries a WARNING)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    status = write_assets(out, seed=seed)  # the actor model and data (kept when present)
    lm_dir, judge_dir = out / MODEL_DIR, out / JUDGE_DIR
    if not force and (judge_dir / "config.json").is_file() and (judge_dir / "model.safetensors").is_file():
        status[str(judge_dir)] = "kept"
        return status
    shutil.rmtree(judge_dir, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(lm_dir))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(lm_dir), dtype=torch.float32)
    steps, (right, wrong, policy) = train_judge(model, tok, seed, max_steps, progress=lambda step, acc: print(
        f"judge step {step}: right on {acc[0]:.3f} / {acc[1]:.3f} / {acc[2]:.3f} of right / wrong / policy's wrong",
        file=sys.stderr, flush=True))
    reached = (f"{steps} steps; verdicts right on {right:.3f} of the right answers and {wrong:.3f} of the wrong ones, "
               f"{policy:.3f} of the warm-started policy's wrong samples")
    below = min(right, wrong) < JUDGE_TARGET
    if below and not allow_below_target:  # a judge that passes wrong sums is what a policy games: not written
        raise DemoFailed(f"judge --seed {seed}: below the {JUDGE_TARGET} target after --max-steps={max_steps} ({reached}); "
                         f"not written, since a policy trained on it can game it (docs/judge.md). Fix: a larger "
                         f"--max-steps, another --seed, or --allow-below-target to write it anyway")
    model.save_pretrained(str(judge_dir), safe_serialization=True)
    tok.save_pretrained(str(judge_dir))
    status[str(judge_dir)] = f"written ({reached})"
    if below:
        status[str(judge_dir)] += (f"; WARNING: below the {JUDGE_TARGET} target after --max-steps={max_steps}: a policy "
                                   "trained on this judge can game it (docs/judge.md); fix: a larger --max-steps or "
                                   "another --seed")
    return status


def _add_arguments(p) -> None:
    p.add_argument("--max-steps", type=int, default=JUDGE_MAX_STEPS,
                   help=f"most training steps; it stops once both verdict accuracies reach {JUDGE_TARGET}")
    p.add_argument("--allow-below-target", action="store_true",
                   help=f"write the judge even if it is below {JUDGE_TARGET} after --max-steps (a policy can game it); "
                        "default: exit 1 without writing it")


def _write(args) -> dict[str, str]:
    if args.max_steps < 1:
        raise UsageError("--max-steps must be >= 1")
    return write_judge(args.out, seed=args.seed, force=args.force, max_steps=args.max_steps,
                       allow_below_target=args.allow_below_target)


DEMO = Demo("judge", "the judge quickstart's judge (a causal LM answering yes/no on the actor's body)",
            "outputs/quickstart", 0, _add_arguments, _write)
