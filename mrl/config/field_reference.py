"""Markdown reference of every config key (default and description), generated from the models.

``python -m mrl.config.field_reference`` prints it; docs/config.md embeds it between markers and a test
checks that the copy is current, so the docs never drift from the defaults declared in code.
"""
from __future__ import annotations

import json

from pydantic import BaseModel

from mrl.config.loader import _section_class
from mrl.config.root import MRLConfig

BEGIN = "<!-- BEGIN GENERATED: python -m mrl.config.field_reference -->"
END = "<!-- END GENERATED -->"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows: list[str] = []
    for name, field in model.model_fields.items():
        desc = (field.description or "").replace("|", "\\|")  # a bare | would split the table cell
        sub = _section_class(field.annotation)
        if sub is not None:
            if field.default is None:  # an optional section: null has a meaning of its own, say it
                rows.append(f"| `{prefix}{name}` | `null` | {desc} |")
            rows.extend(_rows(sub, f"{prefix}{name}."))
            continue
        default = field.get_default(call_default_factory=True)
        shown = json.dumps(default if not isinstance(default, tuple) else list(default))
        rows.append(f"| `{prefix}{name}` | `{shown}` | {desc} |")
    return rows


def field_reference() -> str:
    """One markdown table per top-level section."""
    out = [BEGIN]
    for name, field in MRLConfig.model_fields.items():
        sub = _section_class(field.annotation)
        assert sub is not None
        out += ["", f"### `{name}` — {field.description}", "", "| key | default | meaning |", "| --- | --- | --- |"]
        out += _rows(sub, f"{name}.")
    out += ["", END]
    return "\n".join(out)


if __name__ == "__main__":
    print(field_reference())
