"""A local byte-level BPE tokenizer (no downloads) for the tiny test models: the quickstart's.

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


def build_tokenizer():
    # The package's quickstart tokenizer is the single definition; tests use the same one.
    from mrl.quickstarts.base import build_tokenizer as _build

    return _build()


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


CHATML_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def add_chat_template(path: str | Path, template: str = CHATML_TEMPLATE) -> None:
    """Give the saved tokenizer a chat template (ChatML-like, over its own special tokens)."""
    cfg_path = Path(path) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))


OTHER_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
OTHER_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_other_tokenizer(path: str | Path) -> int:
    """A tokenizer unlike the tiny one, for a reward model that does not share the actor's: byte-level
    with no merges (a digit string is one id per byte), other special tokens (<|endoftext|>=0 pad and
    eos, <|im_start|>=1, <|im_end|>=2) and a ChatML chat template. Returns its vocabulary size (260)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    n = 256 + len(OTHER_SPECIALS)
    tok.train_from_iterator(["a"], trainer=trainers.BpeTrainer(
        vocab_size=n, special_tokens=OTHER_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tok.get_vocab_size() == n, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|unk|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.save_pretrained(str(path))
    cfg_path = Path(path) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "TokenizersBackend"
    cfg["chat_template"] = OTHER_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return n
