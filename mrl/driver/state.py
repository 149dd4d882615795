"""Trainer state next to the actor checkpoint: ``<dir>/global_step_<N>/{actor/, trainer_state.json}``
plus ``<dir>/latest_checkpointed_iteration.txt`` (verl's layout)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

LATEST = "latest_checkpointed_iteration.txt"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def write_trainer_state(root: str | Path, step: int, state: dict[str, Any]) -> None:
    """Write the JSON state of ``step``, then mark it the latest (after the actor's save finished)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, **state}, indent=1))
    (Path(root) / LATEST).write_text(str(step))


def find_resume_dir(root: str | None, resume_mode: str) -> Path | None:
    """trainer.resume_mode: ``disable`` -> None; ``auto`` -> newest complete checkpoint under root or
    None; anything else is a ``global_step_<N>`` path that must exist."""
    if resume_mode == "disable":
        return None
    if resume_mode != "auto":
        d = Path(resume_mode)
        if not (d / "trainer_state.json").is_file():
            raise FileNotFoundError(f"trainer.resume_mode={resume_mode!r}: no trainer_state.json there; "
                                    "fix: point it at a global_step_<N> directory, or use auto|disable")
        return d
    if not root or not (Path(root) / LATEST).is_file():
        return None
    d = step_dir(root, int((Path(root) / LATEST).read_text().strip()))
    return d if (d / "trainer_state.json").is_file() else None


def prune_checkpoints(root: str | Path, keep: int | None) -> list[Path]:
    """trainer.max_ckpt_to_keep: delete all but the newest ``keep`` complete ``global_step_<N>``
    directories (never the one ``latest`` names). Called after a save has been marked latest, so a
    crash mid-save never leaves the run without a complete checkpoint. Returns what was removed."""
    if keep is None:
        return []
    latest_file = Path(root) / LATEST
    latest = int(latest_file.read_text().strip()) if latest_file.is_file() else None
    steps = sorted(int(m.group(1)) for p in Path(root).iterdir()
                   if (m := re.fullmatch(r"global_step_(\d+)", p.name)) and (p / "trainer_state.json").is_file())
    removed = []
    for step in steps[: max(0, len(steps) - keep)]:
        if step != latest:
            shutil.rmtree(step_dir(root, step))
            removed.append(step_dir(root, step))
    return removed


def read_trainer_state(d: Path) -> dict[str, Any]:
    return json.loads((d / "trainer_state.json").read_text())
