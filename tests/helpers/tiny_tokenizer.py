"""A local byte-level BPE tokenizer (no downloads) for the tiny test models.

Byte-level BPE is what Qwen2/Qwen3/Llama-3 ship, so ``AutoTokenizer`` loads it faithfully under
every family's own tokenizer class in transformers 5. The 256 byte symbols plus 4 special tokens
plus a few merges learnt from a toy arithmetic corpus give ``VOCAB_SIZE`` entries.
Special tokens: <pad>=0, <s>=1, </s>=2, <unk>=3.
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 300
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def _corpus():
    for a in range(30):
        for b in range(30):
            yield f"question: what is {a} + {b} ? answer: {a + b}"
            yield f"question: what is {a} times {b} ? answer: {a * b}"


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def save_tiny_tokenizer(path: str | Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(), pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(str(path))
    cfg_path = Path(path) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "TokenizersBackend"
    cfg_path.write_text(json.dumps(cfg, indent=2))
