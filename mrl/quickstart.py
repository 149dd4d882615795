"""Write the quickstart's assets locally, with no download: ``python -m mrl.quickstart --out outputs/quickstart``.

* ``<out>/tiny-qwen2/``: a random Qwen2-style HF checkpoint (vocab 300, hidden 64, intermediate
  128, 4 layers, 4 heads, 2 KV heads, tied embeddings, fp32) with a byte-level BPE tokenizer trained
  here on the toy corpus with the ``tokenizers`` library (256 byte symbols + 4 specials + merges).
  Special tokens: <pad>=0, <s>=1, </s>=2, <unk>=3.
* ``<out>/data/train.jsonl`` and ``val.jsonl``: arithmetic prompts
  ``"question: what is 3 + 4 ? answer:"`` with ``reward_model.ground_truth = "7"`` (verl's row
  layout), graded by the ``arith`` scorer (``reward.function=arith``). Train and val are disjoint.

Everything follows from ``--seed``: two runs write identical bytes. An asset already present is
kept unless ``--force``.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

VOCAB_SIZE = 300
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
MODEL_DIR = "tiny-qwen2"
QWEN2_SHAPE = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
MAX_OPERAND = 30  # a, b in [0, 30): 1800 distinct problems


def problems() -> list[tuple[str, str]]:
    """All (prompt, answer) pairs of the toy task, in a fixed order."""
    out = []
    for a in range(MAX_OPERAND):
        for b in range(MAX_OPERAND):
            out.append((f"question: what is {a} + {b} ? answer:", str(a + b)))
            out.append((f"question: what is {a} times {b} ? answer:", str(a * b)))
    return out


def _corpus() -> Iterator[str]:
    for prompt, answer in problems():
        yield f"{prompt} {answer}"


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


def write_model(path: Path, seed: int) -> None:
    """Tokenizer + random tiny Qwen2 (HF init, seeded) as safetensors in ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    path.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>",
                                   model_max_length=QWEN2_SHAPE["max_position_embeddings"])
    fast.save_pretrained(str(path))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_SHAPE), dtype=torch.float32)
    model.generation_config.pad_token_id = QWEN2_SHAPE["pad_token_id"]
    model.save_pretrained(str(path), safe_serialization=True)


def write_data(data_dir: Path, seed: int, n_val: int) -> None:
    """Shuffle the problems with ``seed``; the first ``n_val`` go to val.jsonl, the rest to train.jsonl."""
    rows = problems()
    random.Random(seed).shuffle(rows)
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, part in (("val", rows[:n_val]), ("train", rows[n_val:])):
        lines = [json.dumps({"data_source": "arith", "prompt": p, "reward_model": {"ground_truth": a, "style": "rule"},
                             "extra_info": {"split": split, "index": i}}) for i, (p, a) in enumerate(part)]
        (data_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_assets(out: str | Path, *, seed: int = 0, n_val: int = 200, force: bool = False) -> dict[str, str]:
    """Write what is missing (everything with ``force``); returns {asset: 'written' | 'kept'}."""
    out = Path(out)
    model_dir, data_dir = out / MODEL_DIR, out / "data"
    status = {}
    model_done = (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file() \
        and (model_dir / "tokenizer.json").is_file()
    if force or not model_done:
        shutil.rmtree(model_dir, ignore_errors=True)
        write_model(model_dir, seed)
        status[str(model_dir)] = "written"
    else:
        status[str(model_dir)] = "kept"
    data_done = (data_dir / "train.jsonl").is_file() and (data_dir / "val.jsonl").is_file()
    if force or not data_done:
        write_data(data_dir, seed, n_val)
        status[str(data_dir)] = "written"
    else:
        status[str(data_dir)] = "kept"
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mrl.quickstart", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="outputs/quickstart", help="output directory (default: outputs/quickstart)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the train/val split")
    p.add_argument("--n-val", type=int, default=200, help="validation prompts (the rest of the 1800 are train)")
    p.add_argument("--force", action="store_true", help="rewrite assets that are already present")
    args = p.parse_args(argv)
    if not 0 < args.n_val < len(problems()):
        p.error(f"--n-val must be in 1..{len(problems()) - 1}")
    for asset, what in write_assets(args.out, seed=args.seed, n_val=args.n_val, force=args.force).items():
        print(f"{what}: {asset}" + ("  (present; --force rewrites it)" if what == "kept" else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
