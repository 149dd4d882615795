"""Write the quickstart's assets locally, with no download: ``python -m mrl.quickstarts base --out outputs/quickstart``.

* ``<out>/tiny-qwen2/``: a tiny Qwen2-style HF checkpoint (vocab 300, hidden 64, intermediate
  128, 4 layers, 4 heads, 2 KV heads, tied embeddings, fp32) with a byte-level BPE tokenizer trained
  here with the ``tokenizers`` library (256 byte symbols + 4 specials + merges) on a broader
  arithmetic corpus (operands < 30, ``+`` and ``times``), so that it has its 300 entries.
  Special tokens: <pad>=0, <s>=1, </s>=2, <unk>=3.
  The weights are HF's seeded random init followed by a short supervised **warm start**
  (``warm_start``: AdamW steps of cross-entropy on ``prompt + " " + answer + "</s>"``, answer tokens
  only, until greedy accuracy reaches ``WARM_START_TARGET``, at most ``--warm-start-steps``). It
  stops early on purpose: the model answers about a third of the problems, so GRPO starts with
  reward signal in most groups and has room to raise the score. ``--warm-start-steps 0`` writes
  the plain random model.
* ``<out>/data/train.jsonl`` and ``val.jsonl``: single-digit addition prompts
  ``"question: what is 3 + 4 ? answer:"`` with ``reward_model.ground_truth = "7"`` (verl's row
  layout), graded by the ``arith`` scorer (``reward.function=arith``). There are only 100 problems:
  train holds all of them and val ``--n-val`` of them (all by default), so val OVERLAPS train — it
  measures how well the policy solves the task it trains on, not generalization.

Everything follows from ``--seed``: two runs on one host and torch build write identical bytes (the
warm start runs on one thread, with a seeded init and a seeded batch order). An asset already present is kept unless
``--force``.
"""
from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

from mrl.quickstarts.cli import Demo

VOCAB_SIZE = 300
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
MODEL_DIR = "tiny-qwen2"
QWEN2_SHAPE = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
MAX_OPERAND = 10  # a, b in [0, 10): 100 problems, sums 0..18 -- within a 0.2M-parameter model's reach
TOKENIZER_MAX_OPERAND = 30  # the tokenizer's corpus is wider: 100 problems are too little text for 300 entries
# Warm start: supervised steps until the model answers WARM_START_TARGET of the problems greedily
# (checked every WARM_START_CHECK steps), at most --warm-start-steps. Addition is learnt in a sudden
# jump whose step depends on the seed and batch order, so a fixed step count would start GRPO anywhere
# on that jump; a target gives every seed a similar start (docs/rewards.md, docs/driver.md).
WARM_START_STEPS, WARM_START_BATCH, WARM_START_LR = 400, 64, 3e-3
WARM_START_TARGET, WARM_START_CHECK = 0.3, 5
# Within the jump the accuracy moves fast: once it passes WARM_START_NEAR it is checked every step, so the
# start lands at the target, not past it as with a check every WARM_START_CHECK steps.
WARM_START_NEAR = 0.1


def problems() -> list[tuple[str, str]]:
    """All (prompt, answer) pairs of the toy task (single-digit addition), in a fixed order."""
    return [(f"question: what is {a} + {b} ? answer:", str(a + b))
            for a in range(MAX_OPERAND) for b in range(MAX_OPERAND)]


def _corpus() -> Iterator[str]:
    for a in range(TOKENIZER_MAX_OPERAND):
        for b in range(TOKENIZER_MAX_OPERAND):
            yield f"question: what is {a} + {b} ? answer: {a + b}"
            yield f"question: what is {a} times {b} ? answer: {a * b}"


def build_tokenizer():
    """Byte-level BPE with exactly VOCAB_SIZE entries, trained on the toy corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, expected {VOCAB_SIZE}")
    return tok


def greedy_accuracy(model, tokenizer) -> float:
    """Fraction of ``problems()`` whose greedy answer is right by the ``arith`` rule (first integer)."""
    import torch

    from mrl.rewards.scorers import arith

    rows = problems()
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in rows]
    P = max(map(len, enc))
    ids = torch.zeros(len(enc), P, dtype=torch.long)  # left-padded, as the engine sees prompts
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, P - len(e):], mask[i, P - len(e):] = torch.tensor(e), 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             pad_token_id=QWEN2_SHAPE["pad_token_id"], eos_token_id=QWEN2_SHAPE["eos_token_id"])
    answers = tokenizer.batch_decode(out[:, P:], skip_special_tokens=True)
    return sum(arith(r, a) for r, (_, a) in zip(answers, rows, strict=True)) / len(rows)


def warm_start(model, tokenizer, seed: int, max_steps: int, goal: float = WARM_START_TARGET,
               roll_back: bool = False) -> tuple[int, float]:
    """Supervised warm start in place, until ``greedy_accuracy >= goal`` (checked every
    ``WARM_START_CHECK`` steps, every step above ``WARM_START_NEAR``) or ``max_steps``; returns (steps
    taken, greedy accuracy of the model as left).

    ``roll_back``: land at or below ``goal``, never past it. When a per-step check (above
    ``WARM_START_NEAR``) sees an accuracy above ``goal``, the model goes back to its weights before that
    step, whose check said below ``goal``, and the warm start stops there: it returns that step count
    and that accuracy (``WARM_START_NEAR <= acc < goal``). An accuracy of exactly ``goal`` is kept, so
    a seed that lands on it writes the same bytes either way. A jump past ``goal`` inside one
    ``WARM_START_CHECK``-step stretch below ``WARM_START_NEAR`` is kept (going back would start RL below
    ``WARM_START_NEAR``). Without ``roll_back`` the step that passes ``goal`` is kept, however far past.
    Only the model goes back: the optimizer is this function's own and ends with the warm start.

    AdamW (lr ``WARM_START_LR``, no weight decay) on batches of ``WARM_START_BATCH`` problems drawn
    with ``random.Random(seed)``; the loss is the mean next-token cross-entropy over the answer
    tokens of ``prompt + " " + answer + "</s>"``::

        L = -1/|A| sum_{t in A} log p(x_t | x_<t),   A = positions of " <answer></s>"

    One thread, so that the bytes do not depend on the host's core count.
    """
    import torch

    rows, rng = problems(), random.Random(seed)
    eos = QWEN2_SHAPE["eos_token_id"]
    # every problem tokenized once: (prompt ids, prompt ids + " <answer></s>" ids)
    encoded = []
    for prompt, answer in rows:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        encoded.append((ids, ids + tokenizer(f" {answer}", add_special_tokens=False)["input_ids"] + [eos]))
    opt = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    step, acc = 0, 0.0
    try:
        while step < max_steps and acc < goal:
            # one step from here on, and this state's accuracy is known (< goal): the roll-back point
            before = {k: v.clone() for k, v in model.state_dict().items()} \
                if roll_back and acc >= WARM_START_NEAR else None
            model.train()
            for _ in range(min(WARM_START_CHECK if acc < WARM_START_NEAR else 1, max_steps - step)):
                seqs, starts = [], []
                for p, full in (rng.choice(encoded) for _ in range(WARM_START_BATCH)):
                    seqs.append(full)
                    starts.append(len(p))
                ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)  # right-padded, <pad>=0
                target = torch.zeros_like(ids, dtype=torch.bool)  # True on the answer tokens
                for i, (s, k) in enumerate(zip(seqs, starts, strict=True)):
                    ids[i, :len(s)] = torch.tensor(s)
                    target[i, k:len(s)] = True
                logits = model(input_ids=ids).logits[:, :-1]  # causal: the right pads change nothing before them
                nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                loss = nll[target[:, 1:]].mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
            model.eval()
            new_acc = greedy_accuracy(model, tokenizer)
            if before is not None and new_acc > goal:
                model.load_state_dict(before)  # past the goal in one step: stop at the state before it
                step -= 1
                break
            acc = new_acc
    finally:
        torch.set_num_threads(threads)
    return step, acc


def write_model(path: Path, seed: int, warm_start_steps: int = WARM_START_STEPS, hf_config=None,
                target: float = WARM_START_TARGET, init=None, roll_back: bool = False) -> tuple[int, float] | None:
    """Tokenizer + tiny Qwen2 (HF init, seeded, then ``warm_start``) as safetensors in ``path``;
    returns ``warm_start``'s (steps, greedy accuracy), None without a warm start. ``hf_config``: another
    architecture on the same tokenizer and task (the MoE quickstart's models, mrl/quickstarts/moe.py);
    ``target``: the warm start's greedy accuracy (the distillation demo's teacher trains further);
    ``init``: called on the seeded model before the warm start (state HF's init leaves at zero);
    ``roll_back``: ``warm_start``'s, land at or below the target."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
        PreTrainedTokenizerFast,
        Qwen2Config,
    )

    path.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   model_max_length=QWEN2_SHAPE["max_position_embeddings"])
    fast.save_pretrained(str(path))
    torch.manual_seed(seed)
    config = hf_config or Qwen2Config(**QWEN2_SHAPE)
    # a vision-language checkpoint (Qwen3.5's released form) is saved whole: decoder and vision tower
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    if init is not None:
        init(model)
    warm = None
    if warm_start_steps > 0:
        # The tokenizer as the trainer and the engines load it: with config.json present, AutoTokenizer
        # gives a Qwen2Tokenizer whose pre-tokenizer splits digits one by one (" 17" -> " ", "1", "7"),
        # unlike the in-memory ``fast``; the warm start must see the ids RL will see.
        model.config.save_pretrained(str(path))
        warm = warm_start(model, AutoTokenizer.from_pretrained(str(path)), seed, warm_start_steps, target,
                          roll_back)
    model.generation_config.pad_token_id = QWEN2_SHAPE["pad_token_id"]
    model.save_pretrained(str(path), safe_serialization=True)
    return warm


def write_data(data_dir: Path, seed: int, n_val: int) -> None:
    """Shuffle the problems with ``seed``: all of them go to train.jsonl, the first ``n_val`` to
    val.jsonl (val overlaps train: 100 problems are too few to hold any out)."""
    rows = problems()
    random.Random(seed).shuffle(rows)
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, part in (("val", rows[:n_val]), ("train", rows)):
        lines = [json.dumps({"data_source": "arith", "prompt": p, "reward_model": {"ground_truth": a, "style": "rule"},
                             "extra_info": {"split": split, "index": i}}) for i, (p, a) in enumerate(part)]
        (data_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_assets(out: str | Path, *, seed: int = 0, n_val: int = MAX_OPERAND ** 2, force: bool = False,
                 warm_start_steps: int = WARM_START_STEPS, model_dir_name: str = MODEL_DIR, hf_config=None,
                 init=None, roll_back: bool = False) -> dict[str, str]:
    """Write what is missing (everything with ``force``); returns {asset: 'written…' | 'kept'}
    (a warm-started model's entry says how many steps it took and the accuracy it reached).
    ``model_dir_name``/``hf_config``/``init``/``roll_back``: another model on the same task (:func:`write_model`)."""
    out = Path(out)
    model_dir, data_dir = out / model_dir_name, out / "data"
    status = {}
    model_done = (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file() \
        and (model_dir / "tokenizer.json").is_file()
    if force or not model_done:
        shutil.rmtree(model_dir, ignore_errors=True)
        warm = write_model(model_dir, seed, warm_start_steps, hf_config, init=init, roll_back=roll_back)
        status[str(model_dir)] = "written" + (f" (warm start: {warm[0]} steps, greedy accuracy {warm[1]:.2f})"
                                              if warm else "")
    else:
        status[str(model_dir)] = "kept"
    data_done = (data_dir / "train.jsonl").is_file() and (data_dir / "val.jsonl").is_file()
    if force or not data_done:
        write_data(data_dir, seed, n_val)
        status[str(data_dir)] = "written"
    else:
        status[str(data_dir)] = "kept"
    return status


def _add_arguments(p) -> None:
    p.add_argument("--n-val", type=int, default=len(problems()),
                   help=f"validation prompts, taken from the {len(problems())} train problems (default: all)")
    p.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS,
                   help=f"most supervised warm-start steps; it stops once greedy accuracy reaches "
                        f"{WARM_START_TARGET} (default {WARM_START_STEPS}; 0: random weights)")


def writer(model_dir_name: str = MODEL_DIR, hf_config=None, init=None, roll_back: bool = False):
    """``Demo.write`` for this task with a given model (the MoE demo passes its own)."""
    def write(args) -> dict[str, str]:
        from mrl.quickstarts.cli import UsageError

        if not 0 < args.n_val <= len(problems()):
            raise UsageError(f"--n-val must be in 1..{len(problems())}")
        if args.warm_start_steps < 0:
            raise UsageError("--warm-start-steps must be >= 0")
        return write_assets(args.out, seed=args.seed, n_val=args.n_val, force=args.force,
                            warm_start_steps=args.warm_start_steps, model_dir_name=model_dir_name,
                            hf_config=hf_config() if callable(hf_config) else hf_config, init=init,
                            roll_back=roll_back)
    return write


DEMO = Demo("base", "the quickstart: a tiny warm-started Qwen2 and single-digit addition data", "outputs/quickstart", 0, _add_arguments, writer())
