"""docs/config.md carries the current generated key reference, and every key has a description."""
from __future__ import annotations

from pathlib import Path

from mrl.config.field_reference import field_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_reference_is_current() -> None:
    assert field_reference() in DOC.read_text(), "run: python -m mrl.config.field_reference and paste it into docs/config.md"


def test_every_key_is_described() -> None:
    rows = [r for r in field_reference().splitlines() if r.startswith("| `")]
    assert len(rows) > 100
    assert all(not r.endswith("|  |") for r in rows)
