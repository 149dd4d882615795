"""ARCHITECTURE.md names only what exists: every file path it cites (``mrl/driver/trainer.py``, ``driver/batch.py``,
a file named in the package map under its package), every class, ``Class.member``, ``module.function`` and
function it cites, and the quickstarts it lists are ``python -m mrl.quickstarts``'s choices. Names are resolved by
reading the source (ast), not by importing it."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MRL = ROOT / "mrl"
DOC = ROOT / "ARCHITECTURE.md"
CODE_DIRS = (MRL, ROOT / "checkpoints_tools")
# names the doc cites that are not mrl's: other projects' classes and constants, products, a config value
NOT_MRL = {"FastAPI", "LoRA", "MoE", "OpenAI", "ReMax", "TransformerConfig", "TYPE_CHECKING", "auto"}
PLACEHOLDER_FILES = {"file.py"}  # `file.py:fn`, the plugin spec's form


@cache
def _defs() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """(top-level names by module stem, members by class name, members of a module's classes by module stem) over
    mrl/ and checkpoints_tools/."""
    by_module: dict[str, set[str]] = {}
    by_class: dict[str, set[str]] = {}
    in_classes: dict[str, set[str]] = {}
    for d in CODE_DIRS:
        for path in d.rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = by_module.setdefault(path.stem, set())
            for node in tree.body:
                names.update(_bound(node))
                if isinstance(node, ast.ClassDef):
                    members = by_class.setdefault(node.name, set())
                    for item in node.body:
                        members.update(_bound(item))
                        in_classes.setdefault(path.stem, set()).update(_bound(item))
    return by_module, by_class, in_classes


def _bound(node: ast.AST) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    return set()


def _defined_anywhere(name: str) -> bool:
    by_module, _, _ = _defs()
    return any(name in names for names in by_module.values())


def _module_or_package(name: str) -> bool:
    return (MRL / name).is_dir() or (MRL / f"{name}.py").is_file() or (ROOT / name).is_dir()


def _resolve(name: str) -> bool:
    """``Class.member``, ``module.function`` (or ``module.method``: ``ranks.update_policy``, a method of a class
    of ranks.py), ``pkg/module.function``, a class/function name, or an mrl package or module."""
    by_module, by_class, in_classes = _defs()
    if name.endswith("/"):  # a directory: `config/`, `rollout/engine/`, `tests/rollout/conformance/`, `docs/`
        return (MRL / name).is_dir() or (ROOT / name).is_dir()
    if "/" in name:
        path, _, member = name.rpartition(".")
        file = MRL / f"{path}.py"
        return file.is_file() and member in {n for node in ast.parse(file.read_text()).body for n in _bound(node)}
    if "." in name:
        owner, member = name.split(".", 1)
        return any(member in table.get(owner, set()) for table in (by_class, by_module, in_classes))
    return _module_or_package(name) or _defined_anywhere(name) or any(name in m for m in by_class.values())


def _text() -> str:
    return DOC.read_text()


def _backticked(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)  # fenced blocks: read by the other checks
    return re.findall(r"`([^`\n]+)`", prose)


def _cited_names(text: str) -> list[str]:
    """Backticked identifiers and directories (``before_call()``, ``with cpu_support():`` -> cpu_support, ``driver/build.check_inputs``)
    and, anywhere in the text, class names and ``Class.member`` (CamelCase, as in the diagrams)."""
    out = []
    for span in _backticked(text):
        span = span.strip()
        m = re.fullmatch(r"(?:with\s+)?([A-Za-z_][\w/]*(?:\.[A-Za-z_]\w*)*)(?:\([^)]*\))?:?", span)
        if m and not m.group(1).endswith(".py") and not span.startswith(("mrl ", "python ")):
            out.append(m.group(1))
    out += re.findall(r"\b[A-Z][a-z]+[A-Z][A-Za-z]*(?:\.[a-z_]\w*)?\b", text)
    return sorted(set(out))


def _cited_files(text: str) -> list[tuple[str, str | None]]:
    """(path, package or None): every ``*.py`` the text names; a bare file name in the package map is looked up
    under the package its entry describes (``driver/  ... build.py``), others anywhere in mrl/."""
    out: list[tuple[str, str | None]] = []
    block = re.search(r"## Package map\s*```\n(.*?)```", text, re.DOTALL)
    package = None
    for line in (block.group(1).splitlines() if block else []):
        head = re.match(r"^ {0,2}([\w./]+/)\s", line)
        if head:
            package = head.group(1).rstrip("/")
            if package == "mrl":
                package = None
        elif re.match(r"^ {0,2}\S", line):
            package = None  # a top-level module's entry (cli.py, net.py, ...)
        for name in re.findall(r"(?<![\w/.])([a-z_]\w*\.py)\b", line):
            out.append((name, package))
    rest = text.replace(block.group(0), "") if block else text
    for path in re.findall(r"(?<![\w/.])((?:[a-z_]\w*/)*[a-z_]\w*\.py)\b", rest):
        out.append((path, None))
    for path in re.findall(r"(?<![\w.])((?:[a-z_]\w*/)+[a-z_]\w*\.py)\b", block.group(1) if block else ""):
        out.append((path, None))
    return out


def _file_exists(path: str, package: str | None) -> bool:
    if path in PLACEHOLDER_FILES:
        return True
    if "/" in path:
        if package is not None:
            return (MRL / package / path).is_file() or (ROOT / package / path).is_file()
        return any((base / path).is_file() for base in (ROOT, MRL))
    if package is not None:
        base = MRL / package if (MRL / package).is_dir() else ROOT / package
        return any(base.rglob(path))
    return any(any(d.rglob(path)) for d in CODE_DIRS)


def _listed_quickstarts(text: str) -> list[list[str]]:
    return [m.split("|") for m in re.findall(r"python -m mrl\.quickstarts ([\w|]+)", text)]


def _quickstart_choices() -> list[str]:
    """The demos ``python -m mrl.quickstarts`` offers: the keys of cli.py's DEMOS (its subcommands), read with ast."""
    tree = ast.parse((MRL / "quickstarts" / "cli.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "DEMOS" for t in node.targets):
            return [ast.literal_eval(k) for k in node.value.keys]
    raise AssertionError("mrl/quickstarts/cli.py has no DEMOS table")


def _problems(text: str) -> list[str]:
    bad = [f"file {p!r}" + (f" (under {pkg}/)" if pkg else "") for p, pkg in _cited_files(text) if not _file_exists(p, pkg)]
    bad += [f"name {n!r}" for n in _cited_names(text) if n not in NOT_MRL and not _resolve(n)]
    choices = _quickstart_choices()
    bad += [f"quickstarts {listed} != python -m mrl.quickstarts's {choices}" for listed in _listed_quickstarts(text)
            if listed != choices]
    if not _listed_quickstarts(text):
        bad.append("the quickstarts are not listed as `python -m mrl.quickstarts a|b|...`")
    return bad


def test_architecture_names_only_what_exists() -> None:
    assert _problems(_text()) == []


def test_the_checker_reads_paths_names_and_quickstarts() -> None:
    """The checker itself: it resolves what exists and reports what does not (a renamed class, a moved file, a
    method that is not there, a quickstart list that lost demos)."""
    assert _cited_names("`driver/build.check_inputs` and `before_call()` and `with cpu_support():` in RunPlan.phases") \
        == ["RunPlan.phases", "before_call", "cpu_support", "driver/build.check_inputs"]
    assert _resolve("RLTrainer.step") and _resolve("RunPlan.phases") and _resolve("driver/build.check_inputs")
    assert _resolve("ranks.update_policy") and _resolve("check_config") and _resolve("workers")
    assert not _resolve("Trainer.step") and not _resolve("RLTrainer.no_such_phase")
    assert not _resolve("driver/build.no_such_function") and not _resolve("no_such_function")
    assert _resolve("rollout/engine/") and _resolve("docs/") and not _resolve("no_such_dir/")
    choices = "|".join(_quickstart_choices())
    good = f"```\nmrl/\n  driver/   build.py (services)\n```\n`mrl/driver/trainer.py`, `python -m mrl.quickstarts {choices}`"
    assert _problems("## Package map\n\n" + good) == []
    wrong = ("## Package map\n\n```\nmrl/\n  driver/   build.py, rank.py\n```\n`mrl/driver/nope.py` `Trainer.step` "
             "`python -m mrl.quickstarts base|rm`")
    assert _problems(wrong) == ["file 'rank.py' (under driver/)", "file 'mrl/driver/nope.py'", "name 'Trainer.step'",
                                f"quickstarts ['base', 'rm'] != python -m mrl.quickstarts's {_quickstart_choices()}"]
