"""Every number the docs show beside a data file comes from that file, and the MoE recipes' memory figures come from
`mrl plan` (issue 53 item 4; the convention is in docs/testing.md, "Figures in the docs").

The rule, over README.md and docs/*.md: a line that cites ``docs/data/<file>`` (or ``(data/<file>)``) and, when that line
is not a table row itself, every table row after it in the same section (up to the next heading) are *in scope* of that
file (a citation inside a table row covers that row: docs/benchmarks.md's table holds one run per row). Each number on an in-scope line
(outside code spans, link targets and HTML comments; dates, clock times, versions and numbers glued to a word such as
``H200`` or ``bf16`` are names, not figures) must be

- a registered figure (tests/test_doc_figures.py ``FIGURES``: an exact JSON path and display, derived values
  included), or
- a value of the cited file as displayed: some number in it (a value, or a key such as ``"16384"``) that rounds to
  the shown digits (or, before ``%``, whose hundredfold does), or
- marked as prose on its line: ``<!-- prose: 12; 17 -->`` lists the numbers that are not the file's (each must be on
  the line), ``<!-- prose -->`` marks the whole line.

A number changed in the doc, or in the file, then fails unless it is still the file's; a new number next to a citation
fails until it is the file's or marked. The MoE recipe figures (docs/moe.md) are not in a data file: the named command
is ``mrl plan <recipe>``, and ``PLAN_FIGURES`` runs its planner in-process (no Ray, no model: ~2 s for all).
"""
from __future__ import annotations

import json
import re

import pytest

from tests.test_doc_figures import _CITE, DOCS, FIGURES, ROOT, _display, _lookup, _rel

_NUMBER = re.compile(r"(?<![\w.\-/])(\d+(?:\.\d+)?)(?![\w])")
_NAMES = [re.compile(p) for p in (r"\d{4}-\d{2}-\d{2}", r"\b\d{1,2}:\d{2}\b", r"\d+\.\d+\.\d+\w*")]
_HIDDEN = [re.compile(p) for p in (r"`[^`]*`", r"\]\([^)]*\)", r"<!--.*?-->")]
_PROSE = re.compile(r"<!--\s*prose(?::\s*(.*?))?\s*-->")


def _scopes(text: str) -> dict[int, set[str]]:
    """{line index: data files whose scope it is in}: a citing line, and (when that line is not itself a table row)
    the table rows after it in its section."""
    out: dict[int, set[str]] = {}
    section: set[str] = set()
    for i, line in enumerate(text.splitlines()):
        if line.startswith("#"):
            section = set()
        cited = {"docs/data/" + n for n in _CITE.findall(line)}
        row = line.startswith("|")
        if not row:  # a citation in a table row is that row's record only (docs/benchmarks.md: one run per row)
            section |= cited
        if cited or (row and section):
            out[i] = cited | (section if row else set())
    return out


def _numbers(line: str) -> list[tuple[int, int, str]]:
    """(start, end, text) of every number on ``line`` that is a figure (see the module doc)."""
    masked = line
    for pat in (*_HIDDEN, *_NAMES):
        masked = pat.sub(lambda m: " " * len(m.group(0)), masked)
    return [(m.start(1), m.end(1), m.group(1)) for m in _NUMBER.finditer(masked)]


def _values(data) -> list[float]:
    """Every number in a JSON document: values (not booleans) and keys that read as numbers."""
    out: list[float] = []
    if isinstance(data, dict):
        for k, v in data.items():
            try:
                out.append(float(k))
            except ValueError:
                pass
            out += _values(v)
    elif isinstance(data, list):
        for v in data:
            out += _values(v)
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        out.append(float(data))
    return out


def _shows(values: list[float], token: str, percent: bool) -> bool:
    digits = len(token.partition(".")[2])
    return any(f"{v:.{digits}f}" == token or (percent and f"{v * 100:.{digits}f}" == token) for v in values)


def _registered_spans(doc: str, line: str) -> list[tuple[int, int]]:
    spans = []
    for f in FIGURES:
        if f[0] == doc and f[1] in line:
            shown = _display(f[4], _lookup(json.loads((ROOT / f[2]).read_text(encoding="utf-8")), f[3]))
            spans += [(m.start(), m.end()) for m in re.finditer(re.escape(shown), line)]
    return spans


def unexplained(doc: str, text: str) -> list[str]:
    """The in-scope numbers of ``text`` that are neither the cited files' nor marked as prose, one line each."""
    lines = text.splitlines()
    files: dict[str, list[float]] = {}
    bad = []
    for i, cited in sorted(_scopes(text).items()):
        line = lines[i]
        marks = [m.group(1) for m in _PROSE.finditer(line)]
        if any(m is None for m in marks):
            continue  # the whole line is prose
        prose = {t.strip() for m in marks for t in m.split(";")}
        numbers = _numbers(line)
        assert prose <= {n for _, _, n in numbers}, f"{doc}:{i + 1}: prose marker names {prose} not all on the line"
        values = [v for f in sorted(cited) for v in files.setdefault(f, _values(json.loads((ROOT / f).read_text(
            encoding="utf-8"))))]
        spans = _registered_spans(doc, line)
        for start, end, token in numbers:
            if token in prose or any(a <= start and end <= b for a, b in spans):
                continue
            if not _shows(values, token, line[end:].lstrip().startswith("%")):
                bad.append(f"{doc}:{i + 1}: {token} (in {line[max(0, start - 40):end + 20]!r}) is not a number of "
                           f"{', '.join(sorted(cited))}: register it, or mark it <!-- prose: {token} -->")
    return bad


@pytest.mark.parametrize("doc", [_rel(d) for d in DOCS])
def test_every_number_beside_a_data_file_is_the_files_or_marked_prose(doc: str) -> None:
    assert unexplained(doc, (ROOT / doc).read_text(encoding="utf-8")) == []


def test_the_rule_is_not_vacuous() -> None:
    """The gpu.md row of sdpa at 4096 tokens: 1.91 (the file's 1.907) passes; 1.92, or the file's value moved, fails;
    a prose marker lets a number through, and one naming a number not on the line is refused."""
    text = (ROOT / "docs/gpu.md").read_text(encoding="utf-8")
    row = "| 8 × 4096, micro-batch 1 | `sdpa` | 1.196 | 312 | **31.5 %** | **1.91** | 35.9 |"
    assert row in text and unexplained("docs/gpu.md", text) == []
    assert any("1.92" in b for b in unexplained("docs/gpu.md", text.replace(row, row.replace("1.91", "1.92"))))
    assert any("31.6" in b for b in unexplained("docs/gpu.md", text.replace(row, row.replace("31.5", "31.6"))))
    marked = text.replace(row, row.replace("1.91", "1.92") + " <!-- prose: 1.92 -->")
    assert unexplained("docs/gpu.md", marked) == []
    with pytest.raises(AssertionError, match="prose marker"):
        unexplained("docs/gpu.md", text.replace(row, row + " <!-- prose: 7.77 -->"))
    # outside any citation's scope nothing is checked: the rule follows the citations
    assert unexplained("x.md", "| a | 1.234 |") == []
    assert unexplained("x.md", "## s\nsee docs/data/packing_cpu.json\n| a | 1.234 |")[0].startswith("x.md:3: 1.234")


def _gpu_table_cells(header: str) -> list[tuple[str, str, str]]:
    """(shape, variant, cell under ``header``) of gpu.md's attention-backend table rows."""
    lines = (ROOT / "docs/gpu.md").read_text(encoding="utf-8").splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| shape | variant |"))
    col = [c.strip() for c in lines[head].split("|")].index(header)
    rows = []
    for ln in lines[head + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.split("|")]
        rows.append((cells[1], cells[2].split("`")[1], cells[col].strip("*")))
    return rows


def test_gpu_md_vs_local_column_is_the_files_speedup() -> None:
    data = json.loads((ROOT / "docs/data/gpu_bench_h200_2026-11-28.json").read_text(encoding="utf-8"))
    section = {"8 × 1024, micro-batch 2": data["actor_fwd_bwd"], "8 × 4096, micro-batch 1": data["long_context"]["mfu"]}
    rows = _gpu_table_cells("vs local")
    assert len(rows) == 6 and ("8 × 4096, micro-batch 1", "sdpa", "1.91") in rows
    for shape, variant, cell in rows:
        assert cell == f"{section[shape]['by_variant'][variant]['speedup_vs_local']:.2f}", (shape, variant, cell)


# (doc, line anchor, recipe under mrl_configs/, overrides, what mrl plan reports -> text shown on that line).
# GiB = 2**30 bytes, one decimal, as docs/moe.md writes them.
def _gib(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"


def _actor(r) -> str:
    return _gib(r.memory["actor"].total)


def _actor_parts(r) -> str:
    a = r.memory["actor"]
    return f"{_gib(a.total)} ({a.weights / 2**30:.1f} weights + {a.grads / 2**30:.1f} fp32 grads + " \
           f"{a.optimizer / 2**30:.1f} Adam)"


def _with_ref(r) -> str:
    return _gib(r.device_total()["actor"])


def _engine(r) -> str:
    return _gib(r.device_total()["rollout"])


_DS, _KIMI = "deepseek-v3_grpo_20x8_pp16_ep8.yaml", "kimi-k2_grpo_40x8_pp16_ep16.yaml"
PLAN_FIGURES = [
    ("docs/moe.md", f"| `mrl_configs/{_DS}` |", _DS, (), _actor_parts),
    ("docs/moe.md", f"| `mrl_configs/{_KIMI}` |", _KIMI, (), _actor),
    ("docs/moe.md", "recompute): DeepSeek-V3's", _DS, (), _actor),
    ("docs/moe.md", "at EP16 (`cluster.nnodes=36", _DS, ("cluster.nnodes=36", "actor.megatron.expert_model_parallel_size=16"),
     lambda r: f"{_actor(r)} per actor GPU by `mrl plan`"),
    ("docs/moe.md", "SGLang TP2 engines colocated; ", "gpt-oss-20b_grpo_1x8_ep8.yaml", (),
     lambda r: f"{_actor(r)} per actor GPU by `mrl plan`"),
    ("docs/moe.md", "with the reference and the engine's weights) and", "gpt-oss-20b_grpo_1x8_ep8.yaml", (), _with_ref),
    ("docs/moe.md", "once (EDP1, so the optimizer", "gpt-oss-120b_grpo_6x8_ep32.yaml", (), lambda r: f"{_actor(r)} per"),
    ("docs/moe.md", "per token, 65.1 GiB per GPU", "qwen3-30b-a3b_grpo_1x8_ep8.yaml", (), lambda r: f"{_actor(r)} per GPU"),
    ("docs/moe.md", "over DP 2, the experts' whole", "qwen3-30b-a3b_grpo_1x8_ep8.yaml", (), _with_ref),
    ("docs/moe.md", "Air 106.85B parameters", "glm-4.5-air_grpo_5x8_ep16.yaml", (),
     lambda r: f"{_actor(r)} per actor GPU ({_with_ref(r)} with the reference"),
    ("docs/moe.md", "80 GB H100s once activations", "glm-4.5-air_grpo_5x8_ep16.yaml", (), _engine),
    ("docs/moe.md", "the embeddings), 106.6 GiB", "glm-4.5_grpo_10x8_ep16.yaml", (),
     lambda r: f"{_actor(r)} per actor GPU ({_with_ref(r)} with the reference), {_engine(r)} of engine weights"),
]


@pytest.fixture(scope="module")
def plans():
    from mrl.config import load_config
    from mrl.config.plan_report import build_report

    cache: dict = {}

    def plan(recipe: str, overrides: tuple[str, ...]):
        if (recipe, overrides) not in cache:
            cache[recipe, overrides] = build_report(load_config(ROOT / "mrl_configs" / recipe, list(overrides)))
        return cache[recipe, overrides]
    return plan


@pytest.mark.parametrize("doc,anchor,recipe,overrides,shown", PLAN_FIGURES, ids=[f[1][:30] for f in PLAN_FIGURES])
def test_moe_md_memory_figures_are_mrl_plans(plans, doc, anchor, recipe, overrides, shown) -> None:
    lines = [ln for ln in (ROOT / doc).read_text(encoding="utf-8").splitlines() if anchor in ln]
    assert len(lines) == 1, f"anchor {anchor!r} is on {len(lines)} lines"
    text = shown(plans(recipe, overrides))
    assert text in lines[0], f"`mrl plan mrl_configs/{recipe} {' '.join(overrides)}` gives {text!r}; the line: {lines[0]!r}"


def test_moe_md_recipe_table_memory_column_is_all_checked() -> None:
    """Every row of the recipe table (a recipe and its memory column) has a PLAN_FIGURES entry: a new recipe row
    cannot go unchecked."""
    rows = [ln for ln in (ROOT / "docs/moe.md").read_text(encoding="utf-8").splitlines()
            if re.match(r"\| `mrl_configs/[^`]+\.yaml` \| \d+ \|", ln) and "GiB" in ln]
    assert len(rows) == 2
    for row in rows:
        assert any(f[1] in row for f in PLAN_FIGURES), row
