"""Hostile or broken YAML files: `mrl plan` answers with one message naming the file, exit code 2,
no traceback, and bounded output (issue 19: these gave tracebacks or 72 MB of errors)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from mrl.cli import EXIT_CONFIG, main

_LAUGHS = "".join(
    f"{c}: &{c} [{','.join([f'*{p}'] * 9) if p else ','.join(['lol'] * 9)}]\n"
    for p, c in zip(["", *"abcdefgh"], "abcdefghi", strict=True)
)

CASES = [
    ("non_utf8", b"trainer:\n  seed: 1\n  project_name: \xff\xfe\n", ["bad.yaml:3", "0xff", "UTF-8"]),
    ("deep_nesting", ("actor: " + "[" * 5000 + "]" * 5000 + "\n").encode(), ["nested too deeply"]),
    ("deep_mapping", ("trainer:\n" + "".join(" " * (2 * i) + f"  k{i}:\n" for i in range(60)) + " " * 122 + "v: 1\n").encode(),
     ["nested more than 32 levels"]),
    ("billion_laughs", (_LAUGHS + "actor: {optim: {lr: *i}}\n").encode(), ["alias", "more than 50"]),
    ("duplicate_section", b"trainer:\n  seed: 1\nactor:\n  ppo_epochs: 2\ntrainer:\n  seed: 2\n",
     ["duplicate key 'trainer'", "first at line 1", "line 5"]),
    ("duplicate_key", b"trainer:\n  seed: 1\n  seed: 2\n", ["duplicate key 'seed'"]),
]


@pytest.mark.parametrize("case, content, must_contain", CASES, ids=[c[0] for c in CASES])
def test_bad_yaml_is_a_config_error(case: str, content: bytes, must_contain: list[str], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.yaml"
    f.write_bytes(content)
    t0 = time.monotonic()
    rc = main(["plan", str(f)])
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 60  # refused up front: the billion laughs alone would take hours (bound for a loaded host)
    assert rc == EXIT_CONFIG, err[-2000:]
    assert all(s in err for s in must_contain), f"{case}: {must_contain} not in {err[:2000]}"
    assert "Traceback" not in err and len(err) < 5000, len(err)


def test_many_errors_are_capped(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "many.yaml"
    f.write_text("trainer:\n" + "".join(f"  unknown_{i}: {'x' * 2000}\n" for i in range(500)))
    assert main(["plan", str(f)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "... and" in err and "more" in err and len(err) < 40_000, len(err)
