"""The quickstart's reward model, written locally with no download: ``python -m mrl.quickstart_rm --out outputs/quickstart``.

``<out>/tiny-rm/``: a ``Qwen2ForSequenceClassification`` (num_labels=1) for ``mrl_configs/quickstart_rm.yaml``,
trained here in a few CPU-seconds to prefer correct sums. It starts from the quickstart actor's
warm-started body (``<out>/tiny-qwen2``, written first by ``mrl.quickstart`` when missing) with a
zero score head, and shares its tokenizer, so the RM reads the actor's token ids as they are. Training
is the Bradley–Terry pairwise loss of RLHF reward models (Ouyang et al. 2022, "Training language
models to follow instructions with human feedback", eq. 1) on the 100 addition problems::

    L = -mean log σ(r(x, y_correct) - r(x, y_wrong))

with ``y = " <n></s>"`` as the actor answers, ``x`` the prompt's ids exactly as the dataset encodes
them; each pair draws a problem and a wrong ``n`` in [0, 2·MAX_OPERAND) uniformly (seeded). AdamW
(lr ``RM_LR``) on batches of ``RM_BATCH`` pairs until the pairwise accuracy over ALL 100 × 18
(correct, wrong) pairs reaches ``RM_TARGET`` (checked every ``RM_CHECK`` steps) or ``RM_MAX_STEPS``.
One thread: the bytes depend only on ``--seed`` (and the torch build). Measured (seed 0): 225 steps,
pairwise accuracy 0.984 but top-1 only 0.72 — for 28% of the problems some wrong sum outscores the
right one (a 0.2M-parameter body that itself answers about half the problems); training on all 19
wrong answers per problem for 1000 steps (4 CPU-min) did not raise top-1 (0.71), so the RM stays the
cheap one, and the recipe's curve shows what that imperfection does (docs/reward_model.md).

The RM never sees the rule: the recipe's reward is its score alone (``reward_model.combine=function``
with :func:`score_with_acc`, which returns the RM score as the reward and the ``arith`` rule's
verdict as the extra key ``acc``: validation reports it as ``val-core/arith/acc/mean@1``, so one
sees the policy learn the task from the RM).
"""
from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

from mrl.quickstart import MAX_OPERAND, MODEL_DIR, QWEN2_SHAPE, problems, write_assets

RM_DIR = "tiny-rm"
RM_LR, RM_BATCH, RM_MAX_STEPS, RM_TARGET, RM_CHECK = 1e-3, 64, 600, 0.97, 25


def score_with_acc(solution_str: str, ground_truth: str, data_source: str | None = None,
                   extra_info: dict | None = None) -> dict:
    """reward.function of quickstart_rm.yaml: the RM's score is the reward; ``acc`` = the arith rule
    (reported, never trained on)."""
    from mrl.rewards.scorers import arith

    if not extra_info or "rm_score" not in extra_info:
        raise ValueError("score_with_acc needs extra_info['rm_score']: enable reward_model (quickstart_rm.yaml)")
    return {"score": float(extra_info["rm_score"]), "acc": float(arith(solution_str, ground_truth))}


def _encoded(tokenizer) -> list[tuple[list[int], int, list[list[int]]]]:
    """Per problem: prompt ids, the correct sum, and ``answer(n)`` ids for n in [0, 2·MAX_OPERAND)."""
    from mrl.data.tokenize import encode_prompt

    eos = QWEN2_SHAPE["eos_token_id"]
    answers = [tokenizer(f" {n}", add_special_tokens=False)["input_ids"] + [eos] for n in range(2 * MAX_OPERAND)]
    return [(encode_prompt(tokenizer, p), int(a), answers) for p, a in problems()]


def _scores(model, seqs: list[list[int]]):
    import torch

    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # right-padded with <pad>=0
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
    return model(input_ids=ids).logits[:, 0]  # HF reads the last non-pad token


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


def write_rm(out: str | Path, *, seed: int = 0, force: bool = False,
             max_steps: int = RM_MAX_STEPS) -> dict[str, str]:
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
    pairwise, top1 = rm_accuracy(rm, tok)
    rm.save_pretrained(str(rm_dir), safe_serialization=True)
    tok.save_pretrained(str(rm_dir))
    status[str(rm_dir)] = (f"written (Bradley-Terry: {steps} steps, pairwise accuracy {pairwise:.3f}, "
                           f"top-1 {top1:.2f})")
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mrl.quickstart_rm", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/quickstart", help="output directory (default: outputs/quickstart)")
    p.add_argument("--seed", type=int, default=0, help="seed of the RM's training (and of missing quickstart assets)")
    p.add_argument("--max-steps", type=int, default=RM_MAX_STEPS,
                   help=f"most training steps; it stops once the pairwise accuracy reaches {RM_TARGET}")
    p.add_argument("--force", action="store_true", help="rewrite the RM when present")
    args = p.parse_args(argv)
    if args.max_steps < 1:
        p.error("--max-steps must be >= 1")
    for asset, what in write_rm(args.out, seed=args.seed, force=args.force, max_steps=args.max_steps).items():
        print(f"{what}: {asset}" + ("  (present; --force rewrites it)" if what == "kept" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
