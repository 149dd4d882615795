"""The import rules of ARCHITECTURE.md, read from the source (every import statement, lazy ones in
functions included): light packages stay free of the heavy stack, the generic cluster layer knows
no Megatron, the rollout side knows no trainer internals, and neither mrl's packages nor its files form a
cycle."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

MRL = Path(__file__).resolve().parents[1] / "mrl"
HEAVY = ("ray", "megatron", "sglang", "fastapi", "uvicorn")
FORBIDDEN = {
    "algorithms": HEAVY, "config": HEAVY, "rewards": HEAVY, "data": HEAVY, "plugins": HEAVY, "errors": HEAVY,
    "net": HEAVY, "dtypes": HEAVY, "quiet_stop": HEAVY,
    "cluster": ("megatron", "mrl.megatron", "mrl.workers", "mrl.driver"),
    "rollout": ("mrl.workers", "mrl.megatron", "mrl.driver", "mrl.cluster"),
    # what runs in rank processes (workers/rank.py, side_rank.py included) knows no driver
    "workers": ("mrl.driver",), "megatron": ("mrl.driver",),
    "quickstarts": ("ray", "megatron", "mrl.driver", "mrl.workers"),
}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno


def _graph():
    violations, edges = [], defaultdict(set)
    for path in sorted(MRL.rglob("*.py")):
        rel = path.relative_to(MRL).parts
        pkg = rel[0] if len(rel) > 1 else path.stem
        for mod, line in _imports(path):
            for bad in FORBIDDEN.get(pkg, ()):
                if mod == bad or mod.startswith(bad + "."):
                    violations.append(f"mrl/{'/'.join(rel)}:{line} imports {mod} (mrl.{pkg} must not import {bad})")
            if mod.startswith("mrl.") and mod.split(".")[1] != pkg:
                edges[pkg].add(mod.split(".")[1])
    return violations, edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _module_of(path: Path, root: Path = MRL) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_edges(modules: set[str], path: Path, root: Path = MRL) -> set[str]:
    """The mrl modules (files) ``path`` imports: every statement, lazy and TYPE_CHECKING ones included, relative ones
    resolved; ``from pkg import sub`` names the file ``pkg/sub.py`` when there is one, else ``pkg``'s own file."""
    me = _module_of(path, root)
    here = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                mod = a.name
                while mod and mod not in modules:  # `import mrl.x.y.attr` is not a thing, but be safe
                    mod = mod.rpartition(".")[0]
                if mod:
                    out.add(mod)
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                if f"{mod}.{a.name}" in modules:
                    out.add(f"{mod}.{a.name}")
                elif mod in modules:
                    out.add(mod)
    out.discard(me)
    return out


def _file_graph(root: Path = MRL) -> dict[str, set[str]]:
    paths = sorted(root.rglob("*.py"))
    modules = {_module_of(p, root) for p in paths}
    return {_module_of(p, root): _file_edges(modules, p, root) for p in paths}


def test_layers_import_only_what_they_may():
    violations, _ = _graph()
    assert not violations, "\n".join(violations)


def test_packages_form_no_import_cycle():
    _, edges = _graph()
    assert _cycles(edges) == [], _cycles(edges)


def test_files_form_no_import_cycle():
    """No two of mrl's files import each other, directly or around a loop (an import inside a function or under
    TYPE_CHECKING counts: it is still a dependency of one on the other; break a cycle by moving the shared piece
    to the lower module or by passing values in)."""
    edges = _file_graph()
    cycles = _cycles(edges)
    assert cycles == [], "\n".join(" <-> ".join(c) + ": " + "; ".join(
        f"{a} -> {', '.join(sorted(edges[a] & set(c)))}" for a in c) for c in cycles)


def test_the_file_graph_resolves_each_import_form(tmp_path: Path):
    pkg = tmp_path / "mrl" / "p"
    pkg.mkdir(parents=True)
    (tmp_path / "mrl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("A = 1\ndef f():\n    from mrl.p import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mrl.p.c\n")
    (pkg / "c.py").write_text("from . import a\nfrom .. import p\n")
    g = _file_graph(tmp_path / "mrl")
    assert g["mrl.p"] == {"mrl.p.a"} and g["mrl.p.a"] == {"mrl.p.b"} and g["mrl.p.b"] == {"mrl.p.c"}
    assert g["mrl.p.c"] == {"mrl.p.a", "mrl.p"}
    assert _cycles(g) == [["mrl.p", "mrl.p.a", "mrl.p.b", "mrl.p.c"]]


def test_the_checker_sees_a_violation_and_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = "def f():\n    import megatron.core\n"
    tree_mods = [n.names[0].name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Import)]
    assert tree_mods == ["megatron.core"]  # lazy imports inside functions are read too


def test_the_rollout_client_side_stays_off_the_embedded_engine():
    """The pool, router, client, launcher and weight sender run in the driver and on trainer ranks:
    no web server, and of the embedded engine only the checksum both ends of a weight update compute."""
    rollout = MRL / "rollout"
    bad = []
    for path in sorted(rollout.rglob("*.py")):
        if (rollout / "engine") in path.parents:
            continue
        for mod, line in _imports(path):
            web = mod.split(".")[0] in ("fastapi", "uvicorn", "starlette")
            engine = mod.startswith("mrl.rollout.engine") and mod != "mrl.rollout.engine.checksum"
            if web or engine:
                bad.append(f"{path.relative_to(MRL.parent)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)
