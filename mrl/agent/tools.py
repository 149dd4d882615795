"""Tools: plain Python functions, registered by name (``@register_tool("calculator")``) or named in
the config as ``file.py:fn`` / ``pkg.module:fn`` (mrl/plugins.py), each with an OpenAI function
schema generated from its signature and docstring::

    def calculator(expression: str) -> str:
        '''Evaluate an arithmetic expression exactly.

        Args:
            expression: e.g. "4821 * 37"
        '''

    -> {"type": "function", "function": {"name": "calculator", "description": "Evaluate an ...",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string",
        "description": "e.g. \"4821 * 37\""}}, "required": ["expression"]}}}

The contract (docs/agent.md): a tool takes JSON-typed keyword arguments (the model's ``arguments``
plus the row's ``extra_info.tools_kwargs[<tool>]``) and returns a ``str`` or a JSON value (sent to
the model as its JSON text). It runs in a worker subprocess (mrl/agent/runner.py); whatever it
raises, however long it hangs, whatever it returns, the model gets a tool message and the run goes on.
Imports no torch (``mrl plan`` builds the schemas).
"""
from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from mrl.plugins import closest, declared_names, is_spec, load_callable

_TOOLS: dict[str, Callable[..., Any]] = {}
BUILTIN_MODULE = "mrl.agent.builtin_tools"

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def register_tool(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` as the tool ``name`` (the name the model calls it by)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _TOOLS and _TOOLS[name] is not fn:
            raise ValueError(f"tool {name!r} is registered twice")
        _TOOLS[name] = fn
        fn.__mrl_tool_name__ = name  # type: ignore[attr-defined]
        return fn
    return deco


def builtin_names() -> list[str]:
    """Built-in tool names, read from the decorators without importing the module."""
    return declared_names("agent/builtin_tools.py", "register_tool")


def resolve_tool(spec: str, key: str = "agent.tools") -> Callable[..., Any]:
    """The function of a built-in name or a ``target:fn`` spec; errors name ``key`` and the fix."""
    if is_spec(spec):
        return load_callable(spec, key, _TOOLS)
    if spec not in builtin_names():
        raise ValueError(f"{key}: unknown tool {spec!r}; {closest(spec, builtin_names())}; "
                         "or give your own as path/to/file.py:fn (docs/agent.md)")
    import importlib

    importlib.import_module(BUILTIN_MODULE)
    return _TOOLS[spec]


def tool_name(spec: str, fn: Callable[..., Any]) -> str:
    """The name the model calls: the registered name, else the function's own name."""
    return getattr(fn, "__mrl_tool_name__", None) or (spec if not is_spec(spec) else fn.__name__)


def _json_type(annotation: Any) -> dict[str, Any]:
    if isinstance(annotation, str):  # postponed annotations: the common names
        annotation = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}.get(
            annotation.split("[")[0].strip(), annotation)
    if isinstance(annotation, str) and "|" in annotation:  # postponed "X | None"
        parts = [a.strip() for a in annotation.split("|") if a.strip() != "None"]
        if len(parts) == 1:
            return _json_type(parts[0])
    origin = typing.get_origin(annotation) or annotation
    if origin in (typing.Union, types.UnionType):  # Optional[X] / X | None: the model sends X (or omits it)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0])
    if origin in _JSON_TYPES:
        return {"type": _JSON_TYPES[origin]}
    if origin is typing.Literal:
        return {"type": "string", "enum": list(typing.get_args(annotation))}
    raise ValueError(f"annotation {annotation!r} has no JSON type; use str, int, float, bool, list or dict")


def _docstring(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(description, {arg: description}) from a Google-style docstring (``Args:`` block)."""
    doc = inspect.getdoc(fn) or ""
    head, _, rest = doc.partition("\nArgs:")
    args: dict[str, str] = {}
    cur = None
    for line in rest.splitlines():
        if line.strip() and not line.startswith((" ", "\t")):
            break  # the next section (Returns:, ...)
        m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
        if m:
            cur = m.group(1)
            args[cur] = m.group(2).strip()
        elif cur and line.strip():
            args[cur] += " " + line.strip()
    return " ".join(head.split()), args


def function_schema(fn: Callable[..., Any], name: str, hidden: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """OpenAI's ``{"type": "function", "function": {...}}`` of ``fn``; ``hidden`` parameters (set per
    row through ``extra_info.tools_kwargs``, or with a default the model need not know) are left out."""
    description, arg_docs = _docstring(fn)
    if not description:
        raise ValueError(f"tool {name!r} ({fn.__module__}.{fn.__qualname__}) has no docstring; the model is shown "
                         "its first paragraph as the tool's description: fix: write one (and an Args: block)")
    props: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in hidden or p.name.startswith("_"):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            raise ValueError(f"tool {name!r}: parameter {p.name!r} is positional-only; tools are called with keywords")
        if p.annotation is p.empty:
            raise ValueError(f"tool {name!r}: parameter {p.name!r} has no type annotation; fix: annotate it "
                             "(str, int, float, bool, list or dict) so its JSON schema can be generated")
        try:
            prop = _json_type(p.annotation)
        except ValueError as e:
            raise ValueError(f"tool {name!r}: parameter {p.name!r}: {e}") from None
        if p.name in arg_docs:
            prop["description"] = arg_docs[p.name]
        props[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": props, "required": required}}}


class ToolSpec(typing.NamedTuple):
    """One configured tool: the name the model calls, the config spec (what a worker resolves) and its schema."""

    name: str
    spec: str
    schema: dict[str, Any]


def load_tools(specs: list[str], key: str = "agent.tools") -> dict[str, ToolSpec]:
    """The configured tools by name; unknown names, unimportable files, schema problems and duplicate
    names are errors naming ``key``."""
    out: dict[str, ToolSpec] = {}
    for i, spec in enumerate(specs):
        fn = resolve_tool(spec, f"{key}[{i}]")
        name = tool_name(spec, fn)
        if name in out:
            raise ValueError(f"{key}[{i}]={spec!r}: a second tool named {name!r}; fix: list every tool once")
        try:
            out[name] = ToolSpec(name, spec, function_schema(fn, name))
        except ValueError as e:
            raise ValueError(f"{key}[{i}]={spec!r}: {e}") from None
    return out
