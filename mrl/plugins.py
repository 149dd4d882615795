"""User code from config: the ``pkg.module:fn`` / ``path/to/file.py:fn`` form of an extension point.

Four config keys name a function or class: ``algorithm.adv_estimator``, ``actor.policy_loss``,
``data.sampler.class_path`` and ``reward.function``. Each takes a registry name (``grpo``) or a
spec ``target:attr``:

* ``target`` ending in ``.py`` is a file, imported under a private module name (once per process);
  otherwise an importable module;
* ``attr`` is a callable attribute of it, or a name the import registered with the registry's
  decorator (``@register_adv_est("grpo_difficulty")`` in the file, ``file.py:grpo_difficulty`` in
  the config).

Imports no torch: ``mrl plan`` checks built-in names without the heavy stack — the names come from
the ``@register_*("name")`` decorators of the built-in modules, read from their source with
``ast`` (the decorators stay the single source of names) — and imports a plugin only when one is
configured (to check that it imports, exists and takes the arguments mrl passes).
"""
from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

_PKG = Path(__file__).resolve().parent
FORMS = "<registry name> | pkg.module:fn | path/to/file.py:fn"


def is_spec(value: str) -> bool:
    """True for ``target:attr`` (a plugin), False for a bare registry name."""
    return ":" in value


def declared_names(module_file: str, decorator: str) -> list[str]:
    """Names registered by ``@<decorator>("name")`` in ``mrl/<module_file>``, read without importing it."""
    tree = ast.parse((_PKG / module_file).read_text(), filename=module_file)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            for d in node.decorator_list:
                if (isinstance(d, ast.Call) and getattr(d.func, "id", getattr(d.func, "attr", None)) == decorator
                        and d.args and isinstance(d.args[0], ast.Constant) and isinstance(d.args[0].value, str)):
                    names.append(d.args[0].value)
    return sorted(names)


def closest(name: str, valid: Iterable[str]) -> str:
    """``did you mean 'x'? valid names: a, b, c`` for an error message."""
    valid = sorted(valid)
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
    return f"{hint}valid names: {', '.join(valid)}"


def _load_file(path: Path, key: str, spec: str):
    if not path.is_file():
        raise ValueError(f"{key}={spec!r}: file {str(path)!r} does not exist; fix: {key}={FORMS} "
                         "(a relative path is relative to the working directory)")
    mod_name = f"mrl_plugin_{abs(hash(str(path.resolve())))}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    file_spec = importlib.util.spec_from_file_location(mod_name, path)
    if file_spec is None or file_spec.loader is None:
        raise ValueError(f"{key}={spec!r}: cannot load {str(path)!r} as a Python module; fix: {key}={FORMS}")
    module = importlib.util.module_from_spec(file_spec)
    sys.modules[mod_name] = module
    try:
        file_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise ValueError(f"{key}={spec!r}: importing {str(path)!r} failed: {e!r}; fix the file") from e
    return module


def load_callable(spec: str, key: str, registered: Mapping[str, Any] | None = None) -> Callable:
    """The callable ``spec`` (``pkg.mod:fn`` or ``file.py:fn``) names; the registry ``registered``
    is looked up after the import when the module has no such attribute (a name its decorator registered)."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"{key}={spec!r} is not {FORMS}; fix: e.g. {key}=my_plugins.py:my_fn")
    if target.endswith(".py"):
        module = _load_file(Path(target), key, spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"{key}={spec!r}: cannot import module {target!r} ({e}); fix: {key}={FORMS}") from e
    fn = getattr(module, attr, None)
    if fn is None and registered is not None:
        fn = registered.get(attr)
    if fn is None or not callable(fn):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__]
        public += [n for n, v in (registered or {}).items() if getattr(v, "__module__", None) == module.__name__]
        hint = closest(attr, set(public)).replace("valid names", "callables there") if public else "callables there: none"
        raise ValueError(f"{key}={spec!r}: {target!r} has no callable {attr!r}; {hint}; "
                         f"fix: {key}={target}:<one of them>")
    return fn


def check_signature(fn: Callable, key: str, spec: str, n_positional: int, keywords: Iterable[str]) -> None:
    """Refuse ``fn`` unless it accepts ``n_positional`` positional arguments and every keyword in
    ``keywords`` (by name or ``**kwargs``): the call mrl makes, checked before the run starts."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin/extension callable without a signature: it is called as is
    keywords = list(keywords)
    try:
        sig.bind(*([None] * n_positional), **dict.fromkeys(keywords))
    except TypeError as e:
        raise ValueError(
            f"{key}={spec!r}: {getattr(fn, '__qualname__', fn)}{sig} cannot be called as mrl calls it "
            f"({n_positional} positional arguments and keywords {', '.join(keywords)}): {e}; "
            "fix: accept those arguments (or **kwargs) — see docs/plugins.md") from None


def accepted_keywords(fn: Callable, offered: Iterable[str]) -> set[str]:
    """Which of the ``offered`` keywords ``fn`` takes (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return set(offered)
    return {k for k in offered if k in params and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY}
