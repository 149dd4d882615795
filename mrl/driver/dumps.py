"""Per-sample JSONL dumps of rollouts and validations (verl ``trainer.rollout_data_dir`` /
``trainer.validation_data_dir``, ``RayPPOTrainer._dump_generations``).

One file per dump, ``<dir>/<step>.jsonl``, one JSON object per sample, keys in this order::

    {"input": prompt text, "output": response text, "gts": ground truth, "score": float,
     "step": int, <every reward_extra_info key with one value per sample>}

As in verl, an extra key equal to a base key (a scorer returning ``score``) replaces its value in
place, and an extra key whose list is not one value per sample is left out. Texts are decoded with
``skip_special_tokens=True`` (verl's ``batch_decode``); JSON is written with ``ensure_ascii=False``.
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class GenerationRows:
    """What a dump holds: B samples in the batch's order (``extra``: key -> B values)."""

    inputs: list[str]
    outputs: list[str]
    gts: list[Any]
    scores: list[float]
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.inputs)
        if not len(self.outputs) == len(self.gts) == len(self.scores) == n:
            raise ValueError(f"generation dump rows disagree: {n} inputs, {len(self.outputs)} outputs, "
                             f"{len(self.gts)} gts, {len(self.scores)} scores")


def _plain(v: Any) -> Any:
    """numpy / torch scalars and arrays -> Python values (json refuses them); the rest as given."""
    if hasattr(v, "tolist"):
        return v.tolist()
    if hasattr(v, "item"):
        return v.item()
    return str(v)


def dump_lines(rows: GenerationRows, step: int) -> list[str]:
    """The JSON lines of ``rows`` at ``step`` (no trailing newline)."""
    n = len(rows.inputs)
    cols: dict[str, Sequence[Any]] = {"input": rows.inputs, "output": rows.outputs, "gts": rows.gts,
                                      "score": rows.scores, "step": [step] * n}
    for k, v in rows.extra.items():
        if len(v) == n:
            cols[k] = v
    return [json.dumps({k: v[i] for k, v in cols.items()}, ensure_ascii=False, default=_plain) for i in range(n)]


def dump_generations(out_dir: str | os.PathLike, step: int, rows: GenerationRows) -> Path:
    """Write ``<out_dir>/<step>.jsonl`` (replacing one of an earlier run at the same step); returns it."""
    path = Path(out_dir) / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = dump_lines(rows, step)
    path.write_text("\n".join(lines) + "\n" if lines else "", encoding="utf-8")
    log.info("dumped %d generations to %s", len(lines), path)
    return path
