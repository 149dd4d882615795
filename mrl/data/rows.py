"""Prompt-file rows without torch: reading ``.jsonl`` / ``.parquet`` files, dotted column access and the
:class:`DataError` every prompt-file mistake raises (``mrl plan`` reads files through these before any model
stack is imported; :mod:`mrl.data.dataset` builds on them)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_MISSING = object()


class DataError(ValueError):
    """A user error in a prompt file, naming ``file:row`` and the column; raised while the dataset
    loads, before Ray or Megatron start (``mrl train`` exits 2 with it, like a config error)."""


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a .jsonl (one JSON object per line) or .parquet file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"prompt file {str(p)!r} does not exist; fix: data.train_files / data.val_files")
    if p.suffix == ".jsonl":
        rows = []
        for n, raw in enumerate(p.read_bytes().splitlines(), start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{p}:{n}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8; "
                                "fix: save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{n}: invalid JSON ({e.msg}); fix: one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"{p}:{n}: expected a JSON object, got {type(row).__name__}; fix: one JSON object per line")
            rows.append(row)
        return rows
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except (pa.ArrowException, UnicodeDecodeError) as e:
            raise DataError(f"{p}: cannot read the parquet file ({e}); fix: re-write it (e.g. with pandas.to_parquet)") from None
    raise DataError(f"prompt file {str(p)!r} is neither .jsonl nor .parquet; fix: convert it to one of them")


def get_dotted(row: dict, key: str, default: Any = _MISSING) -> Any:
    """``row['a']['b']`` for key ``a.b``; a flat column literally named ``a.b`` wins."""
    if key in row:
        return row[key]
    cur: Any = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            if default is _MISSING:
                raise KeyError(key)
            return default
        cur = cur[part]
    return cur
