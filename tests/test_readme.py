"""README.md and the pages its content moved to (docs/quickstart.md, running.md, gpus.md, verl_migration.md): every
mrl/make command in their ```bash blocks runs (plans for real, trainings as `mrl train ... --dry-run`, `mrl from-verl`
into a temp file whose YAML `mrl plan` accepts), every tool line's flags exist, every linked file exists, the README
is one screen, and each ✓ of mrl's column in its feature table links a test that exists."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from mrl.cli import main

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PAGES = ["README.md", "docs/quickstart.md", "docs/running.md", "docs/gpus.md", "docs/verl_migration.md"]
TEXT = "\n".join((REPO / p).read_text() for p in PAGES)


def _commands() -> list[str]:
    """Shell lines inside ```bash blocks of the README and its pages, comments stripped."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", TEXT, flags=re.DOTALL):
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


def _make_vars(words: list[str]) -> tuple[str, list[str]]:
    kv = dict(w.split("=", 1) for w in words if "=" in w and w.split("=", 1)[0].isupper())
    return kv.get("CONFIG", "mrl_configs/quickstart.yaml"), shlex.split(kv.get("ARGS", ""))


def _as_mrl_argv(cmd: str) -> list[str] | None:
    """The mrl argv a README line amounts to (train -> --dry-run), None for non-mrl commands."""
    words = shlex.split(cmd)
    if "--" in words:  # ray job submit ... -- mrl train ...
        words = words[words.index("--") + 1:]
    if words[:2] in (["make", "train"], ["make", "plan"]):
        config, args = _make_vars(words[2:])
        return [words[1], config, *args] + (["--dry-run"] if words[1] == "train" else [])
    if words[:1] == ["mrl"] and words[1] in ("plan", "train"):
        return words[1:] + (["--dry-run"] if words[1] == "train" and "--dry-run" not in words else [])
    return None


COMMANDS = [(c, _as_mrl_argv(c)) for c in _commands()]
MRL = [(c, argv) for c, argv in COMMANDS if argv is not None]


def test_readme_has_the_two_commands_and_enough_runnable_ones() -> None:
    cmds = [c for c, _ in COMMANDS]
    assert "make train" in " ".join(cmds) and "make test" in cmds
    assert sum(a[0] == "plan" for _, a in MRL) >= 3 and sum(a[0] == "train" for _, a in MRL) >= 4
    assert any(c.startswith("ray job submit") for c in cmds)
    assert "mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db" in cmds


@pytest.mark.parametrize("cmd, argv", MRL, ids=[c for c, _ in MRL])
def test_readme_command_runs(cmd: str, argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    assert main(argv) == 0, capsys.readouterr().err
    assert "\nplan:\n" in capsys.readouterr().out


def test_make_plan_runs_for_real() -> None:
    # Only when the venv is current: otherwise `make` would start a reinstall inside the test.
    if subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO, check=False).returncode != 0:
        pytest.skip(".venv is not current; `make plan` would reinstall it")
    line = next(c for c in _commands() if c.startswith("make plan") and "ARGS=" in c)
    out = subprocess.run(shlex.split(line), cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "samples per step: 128" in out.stdout  # ARGS sets rollout.n=4: 32 prompts x 4


def test_every_config_named_in_readme_exists() -> None:
    for name in set(re.findall(r"mrl_configs/[\w.\-<>]+\.yaml", TEXT)):
        if "<" not in name:
            assert (REPO / name).is_file(), name


def _tool_help_argv(cmd: str) -> list[str] | None:
    """For the README's other tools: the argv that prints the help of the (sub)command it runs."""
    words = [w for w in shlex.split(cmd) if w != "&"]
    py = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else "python"
    if words[0] == "mrl-ckpt":
        return [py, "-m", "checkpoints_tools.cli", words[1], "--help"]
    if words[:2] == ["mrl", "engine"]:
        return [py, "-m", "mrl", "engine", "--help"]
    if words[:3] == ["python", "-m", "mrl.quickstarts"]:
        return [py, "-m", "mrl.quickstarts", words[3], "--help"]
    if words[0] == "python" and words[1].startswith("benchmarks/"):
        return [py, words[1], "--help"]
    return None


TOOLS = [(c, _tool_help_argv(c)) for c, argv in COMMANDS if argv is None and _tool_help_argv(c)]


def test_readme_lists_the_tools_that_run_today() -> None:
    names = " ".join(c for c, _ in TOOLS)
    for tool in ("mrl-ckpt hf-to-mcore", "mrl-ckpt mcore-to-hf", "mrl engine", "mrl.quickstarts", "benchmarks/"):
        assert tool in names, tool


@pytest.mark.parametrize("cmd,help_argv", TOOLS, ids=[c[:60] for c, _ in TOOLS])
def test_readme_tool_flags_exist(cmd: str, help_argv: list[str]) -> None:
    """Each flag a README tool line uses is one its --help lists (so the line would parse)."""
    out = subprocess.run(help_argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", cmd):
        assert flag in out.stdout, f"README line {cmd!r} uses {flag}, which {' '.join(help_argv[1:])} does not list"


FROM_VERL = [c for c in _commands() if c.startswith("mrl from-verl")]


@pytest.mark.parametrize("cmd", FROM_VERL)
def test_from_verl_lines_run_and_plan(cmd: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    words = shlex.split(cmd)[1:]
    out = tmp_path / "out.yaml"
    if "-o" in words:
        words[words.index("-o") + 1] = str(out)
    else:
        words += ["-o", str(out)]
    assert main(words) == 0, capsys.readouterr().err
    # verl's launches are GPU runs; a run length is what verl derives and mrl asks for (docs/verl_migration.md)
    assert main(["plan", str(out), "cluster.device=cuda", "trainer.total_training_steps=10"]) == 0, capsys.readouterr().err


def test_readme_shows_from_verl_and_the_pages_more() -> None:
    assert any(c.startswith("mrl from-verl") for c in _commands()) and len(FROM_VERL) >= 2


def _links(page: str) -> list[tuple[str, str]]:
    text = (REPO / page).read_text()
    return [(page, target) for target in re.findall(r"\]\(([^)\s]+)\)", text)
            if not target.startswith(("http://", "https://", "#", "mailto:"))]


LINKED = [link for page in [*PAGES, "docs/index.md"] for link in _links(page)]


@pytest.mark.parametrize("page, target", LINKED, ids=[f"{p}->{t}" for p, t in LINKED])
def test_linked_files_exist(page: str, target: str) -> None:
    path = (REPO / page).parent / target.split("#", 1)[0]
    assert path.exists(), f"{page} links {target}, which does not exist"


def test_docs_index_lists_every_doc_page() -> None:
    index = (REPO / "docs" / "index.md").read_text()
    for doc in sorted((REPO / "docs").glob("*.md")):
        assert doc.name == "index.md" or f"]({doc.name})" in index, f"docs/index.md does not link {doc.name}"


def test_readme_is_one_screen_with_a_feature_table_backed_by_tests() -> None:
    lines = README.splitlines()
    assert len(lines) <= 60, f"README.md has {len(lines)} lines; the first screen is at most 60"
    rows = [r for r in lines if r.startswith("| ") and not r.startswith("|---")][1:]
    assert len(rows) >= 8
    for row in rows:
        mrl_cell = row.split("|")[2]
        if "✓" in mrl_cell:
            tests = [t for t in re.findall(r"\]\(([^)]+)\)", mrl_cell) if t.startswith("tests/")]
            assert tests and all((REPO / t).exists() for t in tests), f"a ✓ without an existing test: {row[:80]}"
    assert any("Mixture-of-Experts" in r for r in rows)
