"""Chat-template segments of a multi-turn trajectory, as token ids (docs/agent.md, "Tokens").

The trajectory is a token list that only grows: the prompt (rendered once, with the tools through
the template's ``tools=`` argument), then per turn the engine's sampled ids (kept as they are,
never decoded and re-encoded) and, after a turn with tool calls, one **tool segment**: the template's
text between the end of that assistant turn and the next assistant generation prompt, tokenised on
its own. It is found by rendering a fixed conversation twice::

    prefix = render([user "U", assistant "A"])                       ... A<end-of-turn>
    full   = render([user "U", assistant "A", tool r1, ...], add_generation_prompt=True)
    segment = <end-of-turn> + full[len(prefix):]  minus what the model already emitted of <end-of-turn>

(verl's ToolAgentLoop encodes the tool messages with the template the same way). A template whose
rendering of the fixed conversation changes when tool messages follow cannot be split like this
and is refused with the reason.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_USER, _ASSISTANT = "mrl-agent-user-turn", "mrl-agent-assistant-turn"


class TemplateError(ValueError):
    """The tokenizer's chat template cannot render what the agent loop needs."""


def render(tokenizer: Any, messages: list[dict[str, Any]], *, tools: Sequence[dict] | None = None,
           add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def check_tools_template(tokenizer: Any, tools: Sequence[dict]) -> None:
    """Refuse a tokenizer whose chat template is missing or ignores ``tools=`` (the model would never
    see the tools' schemas), or cannot render tool messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError("the tokenizer of model.path has no chat_template; agent rollouts render the prompt and "
                            "the tool results with it: fix: a model whose tokenizer_config.json has one that "
                            "renders `tools` and `tool` messages (e.g. Qwen2.5's)")
    msgs = [{"role": "user", "content": _USER}]
    if tools and render(tokenizer, msgs, tools=tools) == render(tokenizer, msgs):
        raise TemplateError("the tokenizer's chat_template ignores its tools= argument, so the model would never see "
                            "the tools' schemas; fix: a chat template that renders `tools` (e.g. Qwen2.5's)")
    tool_segment_text(tokenizer, ["probe"], None)


def tool_segment_text(tokenizer: Any, results: Sequence[str], emitted_end: str | None) -> str:
    """The template text that follows an assistant turn with tool calls: the rest of its end-of-turn
    marker (``emitted_end`` = the text of the turn's last sampled token, when that token is the
    marker or its start), one ``tool`` message per result, then the next assistant generation prompt."""
    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    prefix = render(tokenizer, base)
    full = render(tokenizer, base + [{"role": "tool", "content": r} for r in results], add_generation_prompt=True)
    if not full.startswith(prefix) or _ASSISTANT not in prefix:
        raise TemplateError("the chat template renders an assistant turn differently when tool messages follow it, "
                            "so tool results cannot be appended as tokens; fix: a template that renders messages "
                            "one after another (e.g. Qwen2.5's)")
    end = prefix[prefix.rindex(_ASSISTANT) + len(_ASSISTANT):]
    if emitted_end and end.startswith(emitted_end):
        end = end[len(emitted_end):]
    return end + full[len(prefix):]


def tool_segment_ids(tokenizer: Any, results: Sequence[str], last_sampled_id: int | None) -> list[int]:
    """``tool_segment_text`` as token ids (the segment is template + tool text, never model text).

    The template's text is encoded with its special tokens; each tool result as plain text
    (``split_special_tokens``): a result holding ``</s>`` or ``<|im_end|>`` must not become the real
    end-of-turn token and forge the conversation's structure. The results are placed by sentinels in the
    rendered template and encoded piece by piece."""
    emitted = tokenizer.decode([last_sampled_id]) if last_sampled_id is not None else None
    marks = [f"\x00mrl-tool-result-{i}\x00" for i in range(len(results))]
    text = tool_segment_text(tokenizer, marks, emitted)
    ids: list[int] = []
    pos = 0
    for mark, result in zip(marks, results):
        k = text.find(mark, pos)
        if k < 0:
            raise TemplateError("the chat template changes a tool message's content while rendering it, so tool "
                                "results cannot be encoded as plain text; fix: a template that renders it verbatim")
        ids += tokenizer(text[pos:k], add_special_tokens=False)["input_ids"]
        ids += tokenizer(result, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        pos = k + len(mark)
    ids += tokenizer(text[pos:], add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids]
