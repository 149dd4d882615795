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
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

_PKG = Path(__file__).resolve().parent
FORMS = "<registry name> | pkg.module:fn | path/to/file.py:fn"
IMPORT_TIMEOUT_S = 60.0  # far above a plugin that imports torch (docs/plugins.md); one that takes a minute is stuck
#: overrides IMPORT_TIMEOUT_S (seconds) for a plugin whose import is slow but sound (a large dependency, a slow disk)
TIMEOUT_ENV = "MRL_PLUGIN_IMPORT_TIMEOUT_S"


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


def _stamp(target: str) -> float:
    """What a probe's verdict is keyed by besides the target: a file's mtime (an edited plugin is checked again)."""
    path = Path(target)
    return path.stat().st_mtime if target.endswith(".py") and path.is_file() else 0.0


def _refused(target: str) -> str | None:
    """The child-process check's verdict against ``target`` (as it is now) if it refused it (a timeout, sys.exit, a
    crash): that verdict stands, so the module is not imported in this process after all."""
    return _probed.get((target, _stamp(target)))


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
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # a plugin's sys.exit() must not end mrl
        del sys.modules[mod_name]
        raise ValueError(f"{key}={spec!r}: importing {str(path)!r} failed: {e!r}; fix the file") from e
    return module


# The child imports the plugin's module and reports how that ended; Exceptions are left to the in-process
# import (which names them), only what would stop or hang the caller is reported here.
_PROBE = """
import importlib, importlib.util, json, os, sys
sys.path[:] = json.loads(sys.argv[2])
target = sys.argv[1]
try:
    if target.endswith(".py"):
        spec = importlib.util.spec_from_file_location("mrl_plugin_probe", target)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        importlib.import_module(target)
except SystemExit as e:
    sys.stderr.write("\\nMRL-PROBE sys.exit(%r)" % (e.code,)); sys.stderr.flush(); os._exit(90)
except KeyboardInterrupt:
    os._exit(91)
except BaseException:
    os._exit(0)
os._exit(0)
"""
_probed: dict[tuple[str, float], str | None] = {}


def import_timeout_s() -> float:
    """The child-process check's timeout: ``$MRL_PLUGIN_IMPORT_TIMEOUT_S`` when set, else IMPORT_TIMEOUT_S."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return IMPORT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds; fix: e.g. {TIMEOUT_ENV}=300, "
                         f"or unset it for the default {IMPORT_TIMEOUT_S:g} s")
    return value


def probe_import(spec: str, key: str, timeout_s: float | None = None) -> None:
    """Import ``spec``'s module in a child process first (``mrl plan`` runs this before importing a plugin
    itself): a module that calls ``sys.exit``, raises ``KeyboardInterrupt``, hangs or crashes the
    interpreter at import time becomes a ValueError naming the key, instead of ending or freezing the
    caller. The child runs in its own session and its whole group is killed at the timeout. A refusal
    stands: :func:`load_callable` raises it again instead of importing the module in this process."""
    target = spec.rpartition(":")[0]
    if not target:
        return
    stamp = _stamp(target)
    if (target, stamp) not in _probed:
        _probed[(target, stamp)] = _probe(target, key, spec, import_timeout_s() if timeout_s is None else timeout_s)
    err = _probed[(target, stamp)]
    if err:
        raise ValueError(err)


def _stop(proc: subprocess.Popen) -> None:
    """Kill the child's whole group and reap the child, without waiting on its stderr: a process the import
    started in a session of its own may hold that pipe open for as long as it likes."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything the import left running
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    if proc.stderr is not None:
        proc.stderr.close()


def _probe(target: str, key: str, spec: str, timeout_s: float, argv: list[str] | None = None,
           where: str | None = None) -> str | None:
    """Run the import check (``argv``: another child program, :func:`check_in_child`'s) and say how it ended:
    None when it finished, else the refusal naming the key."""
    where = where or f"{key}={spec!r}: importing {target!r}"
    fix = "fix: keep module level to definitions (guard scripts with `if __name__ == \"__main__\":`)"
    argv = argv or [sys.executable, "-c", _PROBE, target, json.dumps(sys.path)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # the fix first: the CLI cuts an error line at 500 characters, and long plugin paths come before it
        return (f"{where} did not finish within {timeout_s:g} s, the import check's timeout; fix: a slow but sound "
                f"import: {TIMEOUT_ENV}=<seconds> (now {timeout_s:g}); a blocking call, input(), a server or a "
                f"download at import time: {fix.removeprefix('fix: ')}")
    finally:
        _stop(proc)
    tail = err.decode(errors="replace").rsplit("MRL-PROBE ", 1)
    if proc.returncode == 90:
        return f"{where} called {tail[-1].strip()}, which would end mrl itself; {fix}"
    if proc.returncode == 91:
        return f"{where} raised KeyboardInterrupt; {fix}"
    if proc.returncode != 0:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        return f"{where} crashed the interpreter ({how}); {fix}"
    return None


# The child of check_in_child: runs an mrl check function (which imports the plugins it checks) and writes its
# JSON result to a file; sys.exit / KeyboardInterrupt at a plugin's import end it as _PROBE's child does.
_CALL = """
import importlib, json, os, sys
sys.path[:] = json.loads(sys.argv[3])
def put(o):
    with open(sys.argv[4], "w") as f:
        json.dump(o, f)
def stopped(e):
    if isinstance(e, SystemExit):
        sys.stderr.write("\\nMRL-PROBE sys.exit(%r)" % (e.code,)); sys.stderr.flush(); os._exit(90)
    if isinstance(e, KeyboardInterrupt):
        os._exit(91)
try:
    mod, _, fn = sys.argv[1].partition(":")
    put({"ok": getattr(importlib.import_module(mod), fn)(*json.loads(sys.argv[2]))})
except (SystemExit, KeyboardInterrupt) as e:
    stopped(e)
except ValueError as e:  # load_callable wraps what the import raised: an exit is still an exit
    stopped(e.__cause__)
    put({"error": str(e)})
except BaseException as e:
    put({"error": "%s: %s" % (type(e).__name__, e)})
os._exit(0)
"""


def check_in_child(call: str, args: list, key: str, specs: list[str], timeout_s: float | None = None) -> Any:
    """Run ``call`` (``mrl.module:function``, a check that imports the plugins ``specs`` name) on ``args`` in a child
    process and return its JSON-able result; its ValueError, or a child that exits, hangs past the timeout or
    crashes, is a ValueError naming ``key``. ``mrl plan``'s one import of a plugin: the check's child (a probe
    child and then an in-process import would import a slow plugin twice)."""
    targets = [t for t in dict.fromkeys(s.rpartition(":")[0] for s in specs) if t]
    for t in targets:
        if (verdict := _refused(t)) is not None:
            raise ValueError(verdict)
    where = f"{key}={specs[0] if len(specs) == 1 else specs!r}: importing {', '.join(repr(t) for t in targets)}"
    with tempfile.TemporaryDirectory(prefix="mrl-plugin-check-") as d:
        out = Path(d) / "result.json"
        argv = [sys.executable, "-c", _CALL, call, json.dumps(args), json.dumps(sys.path), str(out)]
        err = _probe(targets[0] if targets else call, key, specs[0] if specs else "", import_timeout_s()
                     if timeout_s is None else timeout_s, argv=argv, where=where)
        for t in targets:  # the verdict stands for this process (load_callable), as probe_import's
            _probed[(t, _stamp(t))] = err
        if err:
            raise ValueError(err)
        result = json.loads(out.read_text()) if out.is_file() else {"error": f"{where}: the check ended without a result"}
    if "error" in result:
        raise ValueError(result["error"])
    return result["ok"]


def load_callable(spec: str, key: str, registered: Mapping[str, Any] | None = None) -> Callable:
    """The callable ``spec`` (``pkg.mod:fn`` or ``file.py:fn``) names; the registry ``registered``
    is looked up after the import when the module has no such attribute (a name its decorator registered)."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"{key}={spec!r} is not {FORMS}; fix: e.g. {key}=my_plugins.py:my_fn")
    if (verdict := _refused(target)) is not None:
        raise ValueError(verdict)
    if target.endswith(".py"):
        module = _load_file(Path(target), key, spec)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ValueError(f"{key}={spec!r}: cannot import module {target!r} ({e}); fix: {key}={FORMS}") from e
        except (Exception, SystemExit, KeyboardInterrupt) as e:
            raise ValueError(f"{key}={spec!r}: importing module {target!r} failed: {e!r}; fix the module") from e
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
