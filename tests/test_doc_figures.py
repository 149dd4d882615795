"""Figures in the docs that name a results file under docs/data/ match that file (issue 45 item 2).

Every docs/*.md and README.md line that cites ``docs/data/<file>`` (or ``(data/<file>)`` from inside docs/) must name a
file that exists, and every (doc, data file) pair cited must have entries in FIGURES: each entry names a line of the
doc (a substring that identifies one table row or sentence), a path into the JSON and how the doc displays the value;
the displayed value must appear on that line. Changing a number in the doc or in the file fails the test; citing a
new data file without registering its figures here fails it too.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

# (doc, line anchor, data file, JSON path, format). A path element is a key, an index, or a dict selecting the one
# list element whose fields equal it. The format is applied to the value: a format string or a callable.
_PACKING_ROWS = {
    "| local (Megatron's unfused) | padded |": {"backend": "local", "packed": False},
    "| sdpa | padded |": {"backend": "sdpa", "packed": False},
    "| sdpa | packed |": {"backend": "sdpa", "packed": True},
}
FIGURES = [
    entry
    for anchor, sel in _PACKING_ROWS.items()
    for entry in (
        ("docs/performance.md", anchor, "docs/data/packing_cpu.json", ("results", sel, "cpu_s"), "| {:.2f} |"),
        ("docs/performance.md", anchor, "docs/data/packing_cpu.json", ("results", sel, "pad_fraction"),
         lambda v: f"| {v * 100:.0f} % |"),
        ("docs/performance.md", anchor, "docs/data/packing_cpu.json", ("results", sel, "cpu_ratio_vs_padded_sdpa"),
         "| {:.2f}× |"),
    )
] + [
    # the sentence that describes the run names the script's arguments as the file records them
    ("docs/performance.md", "hidden-128 2-layer", "docs/data/packing_cpu.json", ("args", "hidden"), "hidden-{}"),
    ("docs/performance.md", "hidden-128 2-layer", "docs/data/packing_cpu.json", ("args", "layers"), "{}-layer"),
    ("docs/performance.md", "hidden-128 2-layer", "docs/data/packing_cpu.json", ("args", "samples"), " {} samples"),
]

_GPU = "docs/data/gpu_bench_h200_2026-11-28.json"
_GPU_ROWS = {  # gpu.md's attention-backend table: (row anchor) -> (section path, variant)
    f"| {shape} | `{v}`": (sec, v)
    for shape, sec in (("8 × 1024, micro-batch 2", ("actor_fwd_bwd",)), ("8 × 4096, micro-batch 1", ("long_context", "mfu")))
    for v in ("local", "sdpa", "sdpa+packed")
}
FIGURES += [
    entry
    for anchor, (sec, v) in _GPU_ROWS.items()
    for entry in (
        ("docs/gpu.md", anchor, _GPU, (*sec, "by_variant", v, "seconds_per_minibatch"), "| {:.3f} |"),
        ("docs/gpu.md", anchor, _GPU, (*sec, "by_variant", v, "tflops"), "| {:.0f} |"),
        ("docs/gpu.md", anchor, _GPU, (*sec, "by_variant", v, "mfu"), lambda m: f"{m * 100:.1f} %"),
        ("docs/gpu.md", anchor, _GPU, (*sec, "by_variant", v, "peak_gib"), "| {:.1f} |"),
    )
] + [
    (doc, row, _GPU, ("long_context", "longest", run, "by_length", n, key), fmt)
    for doc, row in (("docs/gpu.md", "| 65536 | not tried |"),)
    for run, n, key, fmt in (("with_recompute", "65536", "seconds", "{:.2f} s"),
                             ("with_recompute", "65536", "peak_gib", "{:.1f} GiB"),
                             ("with_recompute", "65536", "mfu", lambda m: f"{m * 100:.1f} %"))
] + [
    ("docs/gpu.md", "| 16384 | 0.67 s", _GPU, ("long_context", "longest", "no_recompute", "by_length", "16384", k), f)
    for k, f in (("seconds", "{:.2f} s"), ("peak_gib", "{:.1f} GiB"))
] + [
    ("docs/benchmarks.md", "2026-11-28, one NVIDIA H200", _GPU, ("long_context", "mfu", "by_variant", "sdpa",
                                                                 "speedup_vs_local"), "{:.2f}× at 8 × 4096"),
    ("docs/benchmarks.md", "2026-11-28, one NVIDIA H200", _GPU, ("actor_fwd_bwd", "by_variant", "sdpa",
                                                                 "speedup_vs_local"), "{:.2f}× at 8 × 1024"),
    ("docs/benchmarks.md", "2026-11-28, one NVIDIA H200", _GPU, ("long_context", "mfu", "by_variant"),
     lambda v: f"(MFU {v['local']['mfu'] * 100:.1f} → {v['sdpa']['mfu'] * 100:.1f} %)"),
    # packed rows vs unpacked sdpa on equal-length rows: the time ratio sdpa / sdpa+packed at both shapes
    ("docs/benchmarks.md", "2026-11-28, one NVIDIA H200", _GPU, (),
     lambda d: "packed rows on equal-length rows {:.2f}–{:.2f}×".format(*sorted(
         s["by_variant"]["sdpa"]["seconds_per_minibatch"] / s["by_variant"]["sdpa+packed"]["seconds_per_minibatch"]
         for s in (d["actor_fwd_bwd"], d["long_context"]["mfu"])))),
    ("docs/benchmarks.md", "2026-11-28, one NVIDIA H200", _GPU, ("long_context", "longest", "with_recompute", "by_length",
                                                                 "65536", "mfu"), lambda m: f"(MFU {m * 100:.1f} %)"),
    ("docs/benchmarks.md", "2026-11-28, one NVIDIA H200", _GPU, ("long_context", "longest", "with_recompute",
                                                                 "longest"), "**{} with full recompute"),
    ("docs/benchmarks.md", "2026-11-28, one NVIDIA H200", _GPU, ("long_context", "longest", "no_recompute",
                                                                 "longest"), "{} tokens without recompute"),
]
FIGURES.append(("docs/gpu.md", "on the CPU benchmark (docs/data/packing_cpu.json)", "docs/data/packing_cpu.json",
                ("results", {"backend": "sdpa", "packed": True}, "cpu_ratio_vs_padded_sdpa"), "that was {:.2f}×"))
_FAM = "docs/data/cuda_check_families_h200_2026-11-28.json"
FIGURES += [
    ("docs/gpu.md", f"| family {fam} |", _FAM, ("rows", {"tag": dt, "check": f"family {fam}: actor log-probs vs transformers "
                                                        "(padded, packed rows) + fwd/bwd"}), fmt)
    for fam in ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
    for dt, fmt in (("float32", lambda r: f"{r['value']:.1e} {r['status']}".replace("e-0", "e-")),
                    ("bfloat16", lambda r: f"{r['value']:.3f} {r['status']}"))
]
_CUDA = "docs/data/cuda_check_bf16_h200_2026-11-28.json"
FIGURES += [("docs/gpu.md", "`cuda_check.py --dtypes bfloat16` (second call)", _CUDA, ("rows",),
             lambda rows: f"**{sum(r['status'] == 'PASS' for r in rows)} PASS, {sum(r['status'] == 'FAIL' for r in rows)} "
                          f"FAIL, {sum(r['status'] == 'SKIP' for r in rows)} SKIP**")]

_CITE = re.compile(r"(?:docs/data/|\(data/)([A-Za-z0-9_.\-]+)")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _citations() -> set[tuple[str, str]]:
    out = set()
    for doc in DOCS:
        for line in doc.read_text(encoding="utf-8").splitlines():
            for name in _CITE.findall(line):
                out.add((_rel(doc), "docs/data/" + name))
    return out


def _lookup(data, path):
    for key in path:
        if isinstance(key, dict):
            hits = [x for x in data if all(x.get(k) == v for k, v in key.items())]
            assert len(hits) == 1, f"{key} selects {len(hits)} elements"
            data = hits[0]
        else:
            data = data[key]
    return data


def _display(fmt, value) -> str:
    return fmt(value) if callable(fmt) else fmt.format(value)


def test_cited_data_files_exist_and_are_registered():
    cited = _citations()
    assert ("docs/performance.md", "docs/data/packing_cpu.json") in cited  # the scan itself works
    for doc, data in sorted(cited):
        assert (ROOT / data).is_file(), f"{doc} cites {data}, which is not in the repository"
        assert any(f[0] == doc and f[2] == data for f in FIGURES), (
            f"{doc} cites {data} but tests/test_doc_figures.py FIGURES checks none of its figures")


def check_figure(doc_text: str, anchor: str, data, path, fmt) -> None:
    lines = [ln for ln in doc_text.splitlines() if anchor in ln]
    assert len(lines) == 1, f"anchor {anchor!r} is on {len(lines)} lines"
    shown = _display(fmt, _lookup(data, path))
    assert shown in lines[0], f"the file's {'/'.join(map(str, path))} displays as {shown!r}; the line reads {lines[0]!r}"


@pytest.mark.parametrize("doc,anchor,data_file,path,fmt", FIGURES,
                         ids=[f"{f[0]}:{f[1][:20]}:{f[3][-1] if f[3] else i}" for i, f in enumerate(FIGURES)])
def test_figure_matches_its_data_file(doc, anchor, data_file, path, fmt):
    data = json.loads((ROOT / data_file).read_text(encoding="utf-8"))
    assert (ROOT / doc).read_text(encoding="utf-8").count(data_file.removeprefix("docs/")) >= 1
    check_figure((ROOT / doc).read_text(encoding="utf-8"), anchor, data, path, fmt)


def test_a_changed_figure_fails():
    """The check is not vacuous: the packing table with 4.65 edited to 4.66 (or the file's value moved) fails."""
    text = (ROOT / "docs/performance.md").read_text(encoding="utf-8")
    data = json.loads((ROOT / "docs/data/packing_cpu.json").read_text(encoding="utf-8"))
    anchor = "| local (Megatron's unfused) | padded |"
    path = ("results", {"backend": "local", "packed": False}, "cpu_s")
    check_figure(text, anchor, data, path, "| {:.2f} |")
    with pytest.raises(AssertionError):
        check_figure(text.replace("| 4.65 |", "| 4.66 |"), anchor, data, path, "| {:.2f} |")
    _lookup(data, path[:-1])["cpu_s"] = 4.70
    with pytest.raises(AssertionError):
        check_figure(text, anchor, data, path, "| {:.2f} |")


# docs/vs_trl.md's reading table states, per paired interval d ± h, how far behind (h - d) and ahead (d + h) the data
# allow mrl; both must follow from the 8-seed table's paired column (no data file: the runs' files were not kept).
_PAIRED = re.compile(r"^\| (digitsum|add)[^|]* \| (\d+) \| [^|]+ \| [^|]+ \| \**([+−-]\d\.\d+) ± (\d\.\d+)\** \|$")
_BOUNDS = re.compile(r"^\| (digitsum|add) \| (\d+) \| ([+−-]\d\.\d+) ± (\d\.\d+) \| (.+?) \| (.+?) \|$")


def _num(s: str) -> float:
    return float(s.replace("−", "-"))


def test_vs_trl_bounds_follow_from_the_intervals():
    text = (ROOT / "docs/vs_trl.md").read_text(encoding="utf-8")
    paired = {(m[1], m[2]): (_num(m[3]), _num(m[4])) for m in map(_PAIRED.match, text.splitlines()) if m}
    bounds = [m for m in map(_BOUNDS.match, text.splitlines()) if m]
    assert len(paired) == 6 and len(bounds) == 6, (paired, bounds)
    for m in bounds:
        d, h = _num(m[3]), _num(m[4])
        assert paired[(m[1], m[2])] == (d, h), f"{m[1]} step {m[2]}: {d} ± {h} is not the table's paired cell"
        behind, ahead = h - d, d + h
        assert f"{ahead:.3f}" in m[6], m[0]
        assert (f"{behind:.3f}" in m[5]) if behind > 0 else (f"ahead by {-behind:.3f} to {ahead:.3f}" in m[5]), m[0]
