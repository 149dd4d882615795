"""Write the agent quickstart's assets locally, with no download:
``python -m mrl.quickstarts agent --out outputs/quickstart_agent`` (docs/agent.md, "The CPU demo").

The task: ``what is 482 * 37 ?`` (a 3-digit times a 2-digit number). A 0.3M-parameter model cannot
multiply in its head; with the ``calculator`` tool it only has to copy the operands into a call and
the result into its answer. A conversation, as the chat template written here renders it::

    tools: calculator(expression)
    user: what is 482 * 37 ?
    assistant: <tool_call>{"name": "calculator", "arguments": {"expression": "482 * 37"}}</tool_call></s>
    tool: 17834
    assistant: 17834</s>

* ``<out>/tiny-qwen2-agent/``: a tiny Qwen2-style checkpoint (vocab 512, hidden 64, 4 layers) with a
  byte-level BPE tokenizer trained here on such conversations, whose ``chat_template`` renders the
  ``tools=`` schemas (one line: name and parameters) and ``tool`` messages. Its weights are HF's
  seeded init, then a short supervised **warm start** on a MIX of two behaviours: half of the
  demonstrations call the calculator as above, half answer directly with the true product
  (which the model cannot compute, so it learns to guess digits). The warm-started policy therefore
  calls the tool on about half of its samples and gets only those right: GRPO has to raise the
  share of tool use (and the accuracy of the copying) to raise the score.
* ``<out>/data/train.jsonl`` / ``val.jsonl``: verl's multi-turn rows (``prompt`` as chat messages,
  ``reward_model.ground_truth`` the product), train and val disjoint.

The warm-start sequences are built exactly as the agent loop builds trajectories (the prompt with
``encode_prompt(..., tools)``, the tool segment with ``mrl.agent.template.tool_segment_ids``), and
only the model's own tokens are supervised.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

from mrl.quickstarts.cli import Demo, UsageError

VOCAB_SIZE = 512
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
MODEL_DIR = "tiny-qwen2-agent"
SHAPE = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
# No literal text between the tags (transformers renders with trim_blocks/lstrip_blocks): every
# newline is written by an expression.
CHAT_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}({{ t.function.parameters.properties | join(', ') }})"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}{{ 'assistant: ' + m.content + '</s>\\n' }}"
    "{% elif m.role == 'tool' %}{{ 'tool: ' + m.content + '\\n' }}"
    "{% else %}{{ m.role + ': ' + m.content + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
N_TRAIN, N_VAL = 1024, 64
TOOL_SHARE = 0.5  # of the warm-start demonstrations; the rest answer directly (and guess)
# Long enough to teach copying (operands into the call, the result into the answer), which GRPO does not:
# a shorter warm start left seeds short of the recipe's target (docs/agent.md, "Three asset seeds").
WARM_START_STEPS, WARM_START_BATCH, WARM_START_LR = 800, 32, 3e-3


def question(a: int, b: int) -> str:
    return f"what is {a} * {b} ?"


def tool_call_text(a: int, b: int) -> str:
    return ' <tool_call>{"name": "calculator", "arguments": {"expression": "' + f"{a} * {b}" + '"}}</tool_call>'


def problems(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, val) operand pairs, disjoint: a in [100, 1000), b in [10, 100)."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    while len(seen) < N_TRAIN + N_VAL:
        seen.add((rng.randrange(100, 1000), rng.randrange(10, 100)))
    pairs = sorted(seen)
    rng.shuffle(pairs)
    return pairs[:N_TRAIN], pairs[N_TRAIN:]


def messages(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": question(a, b)}]


def _corpus(seed: int):
    rng = random.Random(seed + 1)
    for _ in range(4000):
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        yield (f"tools: calculator(expression)\nuser: {question(a, b)}\nassistant:{tool_call_text(a, b)}\n"
               f"tool: {a * b}\nassistant: {a * b}\n")


def build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def tools_schemas() -> list[dict[str, Any]]:
    from mrl.agent.tools import load_tools

    return [t.schema for t in load_tools(["calculator"]).values()]


def demonstration(tok, a: int, b: int, use_tool: bool, schemas) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one warm-start conversation, built as the agent loop builds trajectories."""
    from mrl.agent.template import tool_segment_ids
    from mrl.data.tokenize import encode_prompt

    eos = SHAPE["eos_token_id"]
    ids = encode_prompt(tok, messages(a, b), schemas)
    mask = [0] * len(ids)

    def model_turn(text: str) -> None:
        t = tok(text, add_special_tokens=False)["input_ids"] + [eos]
        ids.extend(t)
        mask.extend([1] * len(t))
    if use_tool:
        model_turn(tool_call_text(a, b))
        seg = tool_segment_ids(tok, [str(a * b)], eos)
        ids.extend(seg)
        mask.extend([0] * len(seg))
    model_turn(f" {a * b}")
    return ids, mask


def warm_start(model, tok, seed: int, steps: int) -> float:
    """Supervised steps (AdamW, cross-entropy on the model's tokens) on the TOOL_SHARE mix; returns the last loss."""
    import torch

    rng = random.Random(seed)
    train, _ = problems(seed)
    schemas = tools_schemas()
    data = [demonstration(tok, a, b, rng.random() < TOOL_SHARE, schemas) for a, b in train]
    opt = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loss = torch.tensor(0.0)
    try:
        model.train()
        for _ in range(steps):
            batch = [rng.choice(data) for _ in range(WARM_START_BATCH)]
            L = max(len(x) for x, _ in batch)
            ids = torch.zeros(len(batch), L, dtype=torch.long)
            tgt = torch.zeros(len(batch), L, dtype=torch.bool)
            for i, (x, m) in enumerate(batch):
                ids[i, :len(x)] = torch.tensor(x)
                tgt[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
            logits = model(input_ids=ids).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = nll[tgt[:, 1:]].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
    finally:
        torch.set_num_threads(threads)
    return float(loss.detach())


def write_model(path: Path, seed: int, steps: int) -> float | None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        PreTrainedTokenizerFast,
        Qwen2Config,
    )

    path.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(seed), pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>", model_max_length=SHAPE["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE), dtype=torch.float32)
    model.config.save_pretrained(str(path))  # the tokenizer as the trainer and engines load it (quickstart.py)
    loss = warm_start(model, AutoTokenizer.from_pretrained(str(path)), seed, steps) if steps > 0 else None
    model.generation_config.pad_token_id = SHAPE["pad_token_id"]
    model.save_pretrained(str(path), safe_serialization=True)
    return loss


def write_data(data_dir: Path, seed: int) -> None:
    train, val = problems(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", train), ("val", val)):
        lines = [json.dumps({"data_source": "agent_arith", "prompt": messages(a, b),
                             "reward_model": {"ground_truth": str(a * b), "style": "rule"},
                             "extra_info": {"split": split, "index": i}}) for i, (a, b) in enumerate(part)]
        (data_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def final_answer_score(solution_str: str, ground_truth: str, data_source: str | None = None,
                       extra_info: dict | None = None) -> dict[str, float]:
    """The demo's reward, from the agent record (extra_info["agent"]), never from the tool's text:

        score = 0.5 * tool_ok + 0.5 * acc
        tool_ok = a calculator call of the trajectory returned the product (the right expression, well formed)
        acc     = the first integer of the model's FINAL turn is the product (it read the result back)

    The half credit for a successful call is what a tiny model needs to find the tool: answers right
    by guessing are ~0, so without it GRPO sees almost no signal."""
    agent = (extra_info or {}).get("agent") or {}
    gt = str(ground_truth).strip()
    tool_ok = any(c.get("status") == "ok" and c.get("result", "").strip() == gt for c in agent.get("tool_calls", []))
    m = re.search(r"-?\d+", agent.get("final_response", "")) if agent.get("stop") == "answer" else None
    acc = m is not None and m.group(0) == gt
    return {"score": 0.5 * float(tool_ok) + 0.5 * float(acc), "acc": float(acc), "tool_ok": float(tool_ok)}


def write_assets(out: str | Path, *, seed: int = 0, force: bool = False,
                 warm_start_steps: int = WARM_START_STEPS) -> dict[str, str]:
    out = Path(out)
    model_dir, data_dir = out / MODEL_DIR, out / "data"
    status = {}
    if force or not (model_dir / "model.safetensors").is_file():
        shutil.rmtree(model_dir, ignore_errors=True)
        loss = write_model(model_dir, seed, warm_start_steps)
        status[str(model_dir)] = "written" + (f" (warm start: {warm_start_steps} steps, loss {loss:.3f})" if loss else "")
    else:
        status[str(model_dir)] = "kept"
    if force or not (data_dir / "val.jsonl").is_file():
        write_data(data_dir, seed)
        status[str(data_dir)] = "written"
    else:
        status[str(data_dir)] = "kept"
    return status


def _add_arguments(p) -> None:
    p.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS,
                   help=f"supervised warm-start steps (default {WARM_START_STEPS}; 0: random weights)")


def _write(args) -> dict[str, str]:
    if args.warm_start_steps < 0:
        raise UsageError("--warm-start-steps must be >= 0")
    return write_assets(args.out, seed=args.seed, force=args.force, warm_start_steps=args.warm_start_steps)


DEMO = Demo("agent", "the agent quickstart: a tiny Qwen2 with a chat template and a calculator task", "outputs/quickstart_agent", 0, _add_arguments, _write)
