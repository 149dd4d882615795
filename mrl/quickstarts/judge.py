"""The judge quickstart's judge, written locally with no download: ``python -m mrl.quickstarts judge --out outputs/quickstart``.

``<out>/tiny-judge/``: a tiny causal LM (the quickstart actor's warm-started Qwen2 body and tokenizer,
fine-tuned here) that answers " yes" or " no" to the judge prompt of ``mrl_configs/quickstart_judge.yaml``:

    TEMPLATE.format(prompt="question: what is 3 + 4 ? answer:", response=" 7")
      = "question: what is 3 + 4 ? answer: 7 ? verdict:"   ->  " yes</s>"   (" 8", " 77", " " -> " no</s>")

It never sees the ground truth (the template has no {ground_truth}): it has learnt which sums are
right. Training (``train_judge``): AdamW (lr ``JUDGE_LR``, decayed linearly to 0) on batches of
``JUDGE_BATCH`` judge prompts, half with the right sum and half with a wrong answer (a near miss
s±1..3, any n < 4·MAX_OPERAND, or an out-of-range one like the RM's: " ", " 71", " 1111"); the loss is
the next-token cross-entropy of the verdict tokens " yes</s>" / " no</s>" only, until the verdict
accuracy (:func:`judge_accuracy`: every problem's right sum and all its wrong sums in [0, 2·MAX_OPERAND)
plus ``N_EXTRA`` out-of-range ones, read where " yes" and " no" first differ) reaches ``JUDGE_TARGET``
(checked every ``JUDGE_CHECK`` steps) or ``--max-steps``.

One thread: the bytes depend only on ``--seed`` (and the torch build).
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

JUDGE_DIR = "tiny-judge"
TEMPLATE = "{prompt}{response} ? verdict:"  # = reward.judge.prompt_template of quickstart_judge.yaml (a test checks)
YES, NO = " yes", " no"
JUDGE_LR, JUDGE_BATCH, JUDGE_MAX_STEPS, JUDGE_TARGET, JUDGE_CHECK = 2e-3, 64, 1500, 0.995, 100
N_EXTRA = 8


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


def judge_accuracy(model, tok, seed: int = 0) -> tuple[float, float]:
    """(accuracy on right answers, accuracy on wrong ones): the verdict read as " yes" vs " no" at the
    token where they first differ (greedy decoding picks the same), over every problem's right sum, all
    its wrong sums in [0, 2·MAX_OPERAND) and ``N_EXTRA`` out-of-range answers."""
    import torch

    y, n, k = _verdict_ids(tok)
    rng = random.Random(seed + 7)
    right = wrong = nr = nw = 0
    with torch.no_grad():
        for p, ans in problems():
            a = int(ans)
            cands = [f" {m}" for m in range(2 * MAX_OPERAND)] + [_extra(a, rng) for _ in range(N_EXTRA)]
            seqs = [tok.encode(TEMPLATE.format(prompt=p, response=c), add_special_tokens=False) + y[:k] for c in cands]
            logits = model(input_ids=_batch(seqs)).logits
            last = torch.tensor([len(s) - 1 for s in seqs])
            says_yes = logits[torch.arange(len(seqs)), last, y[k]] > logits[torch.arange(len(seqs)), last, n[k]]
            for c, v in zip(cands, says_yes.tolist(), strict=True):
                if c == f" {a}":
                    right, nr = right + int(v), nr + 1
                else:
                    wrong, nw = wrong + int(not v), nw + 1
    return right / nr, wrong / nw


def train_judge(model, tok, seed: int, max_steps: int = JUDGE_MAX_STEPS) -> tuple[int, tuple[float, float]]:
    """Verdict fine-tuning in place (module doc); returns (steps, judge_accuracy)."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(seed)
    y, n, _ = _verdict_ids(tok)
    rows = [(p, int(a)) for p, a in problems()]
    opt = torch.optim.AdamW(model.parameters(), lr=JUDGE_LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    step, acc = 0, (0.0, 0.0)
    try:
        while step < max_steps and min(acc) < JUDGE_TARGET:
            model.train()
            for _ in range(min(JUDGE_CHECK, max_steps - step)):
                seqs, starts = [], []
                for i in range(JUDGE_BATCH):
                    p, a = rng.choice(rows)
                    good = i % 2 == 0
                    prompt = tok.encode(TEMPLATE.format(prompt=p, response=f" {a}" if good else _wrong(a, rng)),
                                        add_special_tokens=False)
                    seqs.append(prompt + (y if good else n))
                    starts.append(len(prompt))
                ids = _batch(seqs)
                target = torch.zeros_like(ids, dtype=torch.bool)
                for i, (s, k) in enumerate(zip(seqs, starts, strict=True)):
                    target[i, k:len(s)] = True
                logits = model(input_ids=ids).logits[:, :-1]
                nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                loss = nll[target[:, 1:]].mean()
                for group in opt.param_groups:
                    group["lr"] = JUDGE_LR * (1 - step / max_steps)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
            model.eval()
            acc = judge_accuracy(model, tok, seed)
    finally:
        model.eval()
        torch.set_num_threads(threads)
    return step, acc


def write_judge(out: str | Path, *, seed: int = 0, force: bool = False, max_steps: int = JUDGE_MAX_STEPS) -> dict[str, str]:
    """Write ``<out>/tiny-judge`` (and the quickstart's assets it starts from, when missing)."""
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
    steps, (right, wrong) = train_judge(model, tok, seed, max_steps)
    model.save_pretrained(str(judge_dir), safe_serialization=True)
    tok.save_pretrained(str(judge_dir))
    status[str(judge_dir)] = (f"written ({steps} steps; verdicts right on {right:.3f} of the right answers and "
                              f"{wrong:.3f} of the wrong ones)")
    if min(right, wrong) < JUDGE_TARGET:  # said, not hidden: a judge that passes wrong sums is what a policy games
        status[str(judge_dir)] += (f"; WARNING: below the {JUDGE_TARGET} target after --max-steps={max_steps}: a policy "
                                   "trained on this judge can game it (docs/judge.md: asset seeds 1 and 2 were gamed "
                                   "within 20 steps); fix: a larger --max-steps or another --seed")
    return status


def _add_arguments(p) -> None:
    p.add_argument("--max-steps", type=int, default=JUDGE_MAX_STEPS,
                   help=f"most training steps; it stops once both verdict accuracies reach {JUDGE_TARGET}")


def _write(args) -> dict[str, str]:
    if args.max_steps < 1:
        raise UsageError("--max-steps must be >= 1")
    return write_judge(args.out, seed=args.seed, force=args.force, max_steps=args.max_steps)


DEMO = Demo("judge", "the judge quickstart's judge (a causal LM answering yes/no on the actor's body)",
            "outputs/quickstart", 0, _add_arguments, _write)
