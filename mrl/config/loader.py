"""Load a run config: YAML file + dotted command-line overrides -> validated :class:`MRLConfig`.

Order: parse YAML -> apply overrides (``actor.optim.lr=1e-6``; values parsed as YAML scalars,
lists ``[a,b]``, ``true/false``, ``null``) -> reject unknown keys (naming the key, its section and
the closest valid name) -> pydantic type checks -> cross-field checks (:mod:`mrl.config.validate`).
All errors of a stage are collected and raised together as :class:`ConfigError`. No environment
variables are read. Defaults live only in the pydantic models.
"""
from __future__ import annotations

import difflib
import os
import reprlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mrl.config.root import MRLConfig

# verl users type these top-level names; say where they live in mrl.
_VERL_HINTS = {
    "actor_rollout_ref": "mrl splits verl's actor_rollout_ref into top-level 'actor', 'ref', 'rollout' and 'model'",
    "critic_model": "use the top-level 'critic' section",
    "reward_model": "use the top-level 'reward' section",
    "custom_reward_function": "use reward.function (registry name, 'pkg.module:fn' or 'file.py:fn')",
    **dict.fromkeys(("reward_model.enable_resource_pool", "reward_model.n_gpus_per_node", "reward_model.nnodes"),
                    "verl's reward_pool is reward_model.placement=separate with reward_model.num_devices="
                    "<its n_gpus_per_node * nnodes> (as ref and critic)"),
}


class ConfigError(ValueError):
    """One or more user errors in a config; ``errors`` lists each (key, what, fix) as a sentence."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        where = f" in {source}" if source else ""
        shown = [_clip(e) for e in self.errors[:_MAX_ERRORS_SHOWN]]
        more = len(self.errors) - len(shown)
        lines = "\n".join(f"  - {e}" for e in shown) + (f"\n  ... and {more} more" if more > 0 else "")
        super().__init__(f"{len(self.errors)} config error(s){where}:\n{lines}")


def parse_value(text: str) -> Any:
    """Parse an override value as YAML (numbers, bools, null, [lists], {maps}); fall back to the raw string.
    Read by the file's loader, so ``0.5_2`` stays text here too (see :class:`DigitSeparated`)."""
    try:
        return yaml.load(text, Loader=_StrictLoader) if text.strip() else ""
    except yaml.YAMLError:
        return text


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], parsed value). ValueError names the malformed item."""
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or any(not p for p in parts):
        raise ValueError(f"override {item!r} is not of the form section.key=value; fix: e.g. actor.optim.lr=1e-6")
    return parts, parse_value(value)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """Set each dotted override in ``data`` (in place); returns the errors instead of raising."""
    errors: list[str] = []
    for item in overrides:
        try:
            parts, value = parse_override(item)
        except ValueError as e:
            errors.append(str(e))
            continue
        node = data
        for i, p in enumerate(parts[:-1]):
            child = node.setdefault(p, {})
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                errors.append(
                    f"override {item!r}: '{'.'.join(parts[: i + 1])}' is a value, not a section; "
                    f"fix: set '{'.'.join(parts[: i + 1])}=...' directly"
                )
                break
            node = child
        else:
            node[parts[-1]] = value
    return errors


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel class inside an annotation like ``X``, ``X | None``; None for plain values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            cls = _section_class(arg)
            if cls is not None:
                return cls
    return None


def find_unknown_keys(data: dict[str, Any], model: type[BaseModel], prefix: str = "") -> list[str]:
    """Errors for keys of ``data`` that ``model`` does not declare (recursing into sections); removes them."""
    errors: list[str] = []
    fields = model.model_fields
    section = prefix.rstrip(".") or "<top level>"
    for key in list(data):
        full = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = _VERL_HINTS.get(str(full))
            if hint:
                fix = f"fix: {hint}"
            elif close:
                fix = f"did you mean '{prefix}{close[0]}'?"
            else:
                fix = f"valid keys: {', '.join(fields)}"
            errors.append(f"unknown key '{full}' in section '{section}'; {fix}")
            del data[key]
            continue
        sub = _section_class(fields[key].annotation)
        if sub is not None and data[key] is None and fields[key].default is not None:
            # an empty YAML section (`actor:` with nothing under it) means its defaults; a section whose
            # default is null (reward_model.megatron: the actor's layout) stays null
            data[key] = {}
        if sub is not None and isinstance(data[key], dict):
            errors.extend(find_unknown_keys(data[key], sub, f"{full}."))
    return errors


def _describe(loc: tuple[Any, ...]) -> str | None:
    """The Field description of the key at ``loc`` (for the fix hint), if it resolves to a field."""
    model: type[BaseModel] | None = MRLConfig
    desc = None
    for p in loc:
        if model is None or not isinstance(p, str) or p not in model.model_fields:
            break
        field = model.model_fields[p]
        desc = field.description
        model = _section_class(field.annotation)
    return desc


def _format_validation_error(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        key = ""
        for p in e["loc"]:
            key += f"[{p}]" if isinstance(p, int) else (f".{p}" if key else str(p))
        got = e.get("input")
        got_s = f" (got {reprlib.repr(got)})" if not isinstance(got, dict) else ""
        msg = str(e["msg"]).removeprefix("Value error, ")
        if "fix:" in msg:  # our own validators already say how to fix it
            out.append(f"{key}: {msg}")
            continue
        desc = _describe(e["loc"])
        what = f" ({desc.rstrip('.')})" if desc else ""
        out.append(f"{key}: {msg}{got_s}; fix: give {key} a valid value{what}")
    return out


MAX_DEPTH = 32  # sections nest 4 deep; anything near this is not a config
_MAX_ALIAS_USES = 50  # anchors are rare in configs; billion-laughs files nest dozens of them
_MAX_ERRORS_SHOWN = 30
_MAX_ERROR_CHARS = 500


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last one silently) and caps alias
    expansion (a few KB of anchors can otherwise expand into gigabytes of error messages)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self.alias_uses = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.alias_uses += 1
            if self.alias_uses > _MAX_ALIAS_USES:
                raise yaml.YAMLError(f"more than {_MAX_ALIAS_USES} alias (*anchor) uses; a config does not need them")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"duplicate key {key!r} (first at line {seen[key].line + 1}); the first would be silently "
                    "dropped: merge the two into one", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


class DigitSeparated(str):
    """A plain scalar that YAML 1.1 reads as a number with ``_`` digit separators (``0.5_2`` -> 0.52,
    ``2_0.5`` -> 20.5, ``1_2`` -> 12). mrl keeps it as the text written: a key that takes only text gets
    it (a name such as ``2024_11``); a key that takes a number, or a number or text (a threshold: U or
    the band 'L_U'), refuses it (:func:`digit_separator_errors`): no number-looking value is silently
    read as something else. Quoted (``'0.5_2'``), it is plain text and never this class."""


def _construct_number(loader: yaml.SafeLoader, node: yaml.ScalarNode, base: Any) -> Any:
    if "_" in node.value:
        return DigitSeparated(node.value)
    return base(loader, node)


_StrictLoader.add_constructor("tag:yaml.org,2002:int",
                              lambda ld, n: _construct_number(ld, n, yaml.SafeLoader.construct_yaml_int))
_StrictLoader.add_constructor("tag:yaml.org,2002:float",
                              lambda ld, n: _construct_number(ld, n, yaml.SafeLoader.construct_yaml_float))


def _admits_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    return any(_admits_str(a) for a in typing.get_args(annotation) if not isinstance(a, str))


def _admits_number(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    return any(_admits_number(a) for a in typing.get_args(annotation) if not isinstance(a, str))


def _has_digit_separated(value: Any) -> bool:
    if isinstance(value, DigitSeparated):
        return True
    if isinstance(value, dict):
        return any(_has_digit_separated(v) for v in value.values())
    return isinstance(value, list) and any(_has_digit_separated(v) for v in value)


def _plain(value: Any) -> Any:
    if isinstance(value, DigitSeparated):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return [_plain(v) for v in value] if isinstance(value, list) else value


def digit_separator_errors(data: dict[str, Any], model: type[BaseModel] = MRLConfig, prefix: str = "") -> list[str]:
    """Errors for digit-separated numbers (:class:`DigitSeparated`) given to keys that take a number
    (pydantic's float() would read them as another number) or a number or text (``rollout_is_threshold:
    0.5_2`` could mean 0.52 or the band [0.5, 2]: only the quoted text is unambiguous); those keys are
    removed. Keys that take only text get the plain str."""
    errors: list[str] = []
    fields = model.model_fields
    for key in list(data):
        field = fields.get(key)
        if field is None:
            continue
        sub = _section_class(field.annotation)
        if sub is not None and isinstance(data[key], dict):
            errors.extend(digit_separator_errors(data[key], sub, f"{prefix}{key}."))
        elif _has_digit_separated(data[key]):
            written, name = _plain(data[key]), f"{prefix}{key}"
            if not _admits_str(field.annotation):
                errors.append(f"{name}={written!r}: '_' between digits is YAML 1.1's digit separator "
                              f"(0.5_2 would read as 0.52, 1_2 as 12), which mrl does not accept in a number; fix: "
                              f"write the number without '_' (a band such as [0.5, 2] is a list or the text 'L_U' "
                              f"where the key takes one)")
                del data[key]
            elif _admits_number(field.annotation):
                text = written if isinstance(written, str) else "L_U"
                errors.append(f"{name}={text} is ambiguous: unquoted, YAML 1.1 reads it as one number with a digit "
                              f"separator (0.5_2 as 0.52), while {name} also takes the text 'L_U' (the band "
                              f"[L, U]); fix: quote the band ({key}: '{text}' in YAML, {name}=\"'{text}'\" on the "
                              f"command line) or write one number without '_' (e.g. {name}=2.0)")
                del data[key]
            else:
                data[key] = written
    return errors


def _depth(x: Any, limit: int) -> int:
    """Nesting depth of dicts/lists, stopping once it exceeds ``limit``. YAML aliases share nodes,
    so each container is walked once per depth it is reached at (not once per path to it)."""
    stack, best, seen = [(x, 1)], 0, {}
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list) and seen.get(id(v), 0) < d:
            seen[id(v)] = d
            best = max(best, d)
            if best > limit:
                return best
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return best


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a YAML config file into a dict; ConfigError names the file on any problem."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file '{p}' does not exist; fix: pass a YAML file, e.g. mrl_configs/quickstart.yaml"])
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError([f"{p}:{line}: byte 0x{raw[e.start]:02x} is not UTF-8; fix: save the file as UTF-8"], str(p)) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        raise ConfigError([f"{p}: not valid YAML: {_clip(str(e))}; fix: correct the YAML there"], str(p)) from None
    except RecursionError:
        raise ConfigError([f"{p}: nested too deeply to be a config (more than {MAX_DEPTH} levels); fix: check the file"],
                          str(p)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{p}: the top level must be a mapping of sections (cluster:, actor:, ...), got {type(data).__name__}"], str(p))
    if _depth(data, MAX_DEPTH) > MAX_DEPTH:
        raise ConfigError([f"{p}: nested more than {MAX_DEPTH} levels deep, which no config section is; fix: check the file"], str(p))
    return data


def _clip(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def build_config(data: dict[str, Any]) -> tuple[MRLConfig | None, list[str]]:
    """Dict -> (MRLConfig or None, errors): unknown keys are reported and dropped, type errors collected."""
    errors = find_unknown_keys(data, MRLConfig)
    errors += digit_separator_errors(data)
    try:
        return MRLConfig.model_validate(data), errors
    except ValidationError as e:
        return None, errors + _format_validation_error(e)


def load_config(
    path: str | os.PathLike[str] | None, overrides: list[str] | None = None, *, check: bool = True
) -> MRLConfig:
    """Load ``path`` (None = defaults only), apply ``overrides``, validate; raise ConfigError listing all errors.

    Unknown keys do not hide the other problems: the config without them is still type-checked and,
    when that succeeds, cross-checked, so one run reports everything. ``check=False`` skips the
    cross-field checks (structure and types are always checked).
    """
    source = str(path) if path is not None else None
    data = read_yaml(path) if path is not None else {}
    errors = apply_overrides(data, list(overrides or []))
    cfg, build_errors = build_config(data)
    errors += build_errors
    if cfg is not None and check:
        from mrl.config.validate import check_config

        errors += check_config(cfg)[0]
    if errors or cfg is None:
        raise ConfigError(errors, source)
    return cfg
