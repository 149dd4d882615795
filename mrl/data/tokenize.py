"""Prompt rendering and left-padded tokenization.

Prompts are LEFT-padded so that every prompt ends at column P-1 and generation continues at
column P for the whole batch (verl's ``input_ids``/``attention_mask`` layout)::

    input_ids      [B, P]  pad ... pad t_0 ... t_{L_i-1}
    attention_mask [B, P]  0   ... 0   1   ...  1
    position_ids   [B, P]  0   ... 0   0   ...  L_i-1     (cumsum(mask) - 1, clamped at 0)
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer carries a chat template (``tokenizer.chat_template`` set)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer: Any, prompt: str | Sequence[dict], tools: Sequence[dict] | None = None) -> tuple[str, bool]:
    """(text, templated). Chat messages go through the chat template (with the generation prompt)
    when the tokenizer has one, else their contents are joined by newlines; a string stays as is.
    ``tools``: OpenAI function schemas the template renders (its ``tools=`` argument; agent rollouts)."""
    if isinstance(prompt, str):
        return prompt, False
    messages = list(prompt)
    if not all(isinstance(m, dict) and "content" in m for m in messages):
        raise ValueError("chat prompt must be a list of {'role': ..., 'content': ...} messages")
    if has_chat_template(tokenizer):
        if tools:
            return tokenizer.apply_chat_template(messages, tools=list(tools), add_generation_prompt=True, tokenize=False), True
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), True
    return "\n".join(str(m["content"]) for m in messages), False


def encode_prompt(tokenizer: Any, prompt: str | Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """Token ids of a rendered prompt. A chat template already writes its special tokens, so only a
    plain-text prompt gets the tokenizer's own (e.g. BOS)."""
    text, templated = render_prompt(tokenizer, prompt, tools)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def left_pad(seqs: Sequence[Sequence[int]], pad_token_id: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad B id lists to ``length`` (default: the longest) → (input_ids [B, P] long, attention_mask [B, P] long)."""
    longest = max((len(s) for s in seqs), default=0)
    P = longest if length is None else length
    if longest > P:
        raise ValueError(f"a prompt has {longest} tokens, more than the padded length {P}")
    # padded Python rows, one tensor each (a slice assignment per row is far slower at RL batch sizes;
    # docs/performance.md, 'Rollout batch assembly')
    ids = torch.tensor([[pad_token_id] * (P - len(s)) + list(s) for s in seqs], dtype=torch.long).reshape(len(seqs), P)
    mask = torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long).reshape(len(seqs), P)
    return ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, P] positions: 0 on pads, 0..L-1 on the tokens (cumsum of the mask minus one)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def pad_token_id_of(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id; an error names the fix when it has neither."""
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    raise ValueError("the tokenizer has neither pad_token nor eos_token; fix: set pad_token in tokenizer_config.json of model.path")
