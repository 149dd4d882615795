"""Tool calls in the model's text, by format (``agent.format``).

``hermes`` (Hermes 2 Pro, Qwen2.5/Qwen3 chat templates; verl's and SGLang's ``qwen25``/``hermes``
parsers): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``arguments``
may also be a JSON string holding the object. The text is only read here, never re-encoded: the
trajectory keeps the engine's token ids (docs/agent.md).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes",)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


@dataclass
class ToolCall:
    """One parsed call. ``error`` set: the call was malformed, ``name``/``arguments`` are what could be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    raw: str = ""


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """Every tool call of one model turn, in order; a malformed one comes back with ``error`` set
    (the model is told why, as the tool message). An opened but unclosed ``<tool_call>`` (the turn
    was cut by the length limit) is a malformed call too."""
    if fmt not in FORMATS:
        raise ValueError(f"agent.format={fmt!r} is not a known tool-call format; valid: {', '.join(FORMATS)}")
    calls = [_hermes_one(m.group(1)) for m in _HERMES.finditer(text)]
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if calls else text
    if _HERMES_OPEN in tail:
        raw = tail[tail.index(_HERMES_OPEN):]
        calls.append(ToolCall("", {}, "the <tool_call> is not closed with </tool_call>", raw))
    return calls


def _hermes_one(body: str) -> ToolCall:
    raw = body.strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})", raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'the tool call must be a JSON object {"name": <tool>, "arguments": {...}}', raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], {}, "the tool call's arguments are a string that is not a JSON object", raw)
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, f"the tool call's arguments must be a JSON object, got {type(args).__name__}", raw)
    return ToolCall(obj["name"], args, None, raw)
