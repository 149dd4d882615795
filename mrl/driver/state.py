"""Trainer state next to the actor checkpoint: ``<dir>/global_step_<N>/{actor/, trainer_state.json}``
plus ``<dir>/latest_checkpointed_iteration.txt`` (verl's layout)."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

LATEST = "latest_checkpointed_iteration.txt"
log = logging.getLogger("mrl.driver")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def write_trainer_state(root: str | Path, step: int, state: dict[str, Any]) -> None:
    """Write the JSON state of ``step``, then mark it the latest (after the actor's save finished)."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    _atomic_write(d / "trainer_state.json", json.dumps({"global_step": step, **state}, indent=1))
    _atomic_write(Path(root) / LATEST, str(step))


def _atomic_write(path: Path, text: str) -> None:
    """temp file + fsync + rename: a reader (or a crash) never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_steps(root: str | Path) -> list[int]:
    """Steps under ``root`` whose checkpoint finished: trainer_state.json is written (atomically)
    only after every rank's save returned, so a step directory without it is half-written."""
    if not Path(root).is_dir():
        return []
    return sorted(int(m.group(1)) for p in Path(root).iterdir()
                  if (m := re.fullmatch(r"global_step_(\d+)", p.name)) and (p / "trainer_state.json").is_file())


def _latest_step(root: str | Path) -> int | None:
    """The step ``latest_checkpointed_iteration.txt`` names; when it is unreadable, or names a step
    that is not complete, the newest complete checkpoint (with a warning); None when there is none."""
    f = Path(root) / LATEST
    steps = complete_steps(root)
    try:
        step = int(f.read_text().strip())
    except (OSError, ValueError) as e:
        if not f.exists() and not steps:
            return None
        problem = f"is unreadable ({e})"
    else:
        if step in steps:
            return step
        problem = f"names step {step}, which has no complete checkpoint"
    if steps:
        log.warning("%s %s; resuming from the newest complete checkpoint, %s", f, problem, step_dir(root, steps[-1]))
        return steps[-1]
    log.warning("%s %s and no complete checkpoint exists under %s; starting fresh", f, problem, root)
    return None


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
    if not root:
        return None
    step = _latest_step(root)
    return None if step is None else step_dir(root, step)


def prune_checkpoints(root: str | Path, keep: int | None) -> list[Path]:
    """trainer.max_ckpt_to_keep: delete all but the newest ``keep`` complete ``global_step_<N>``
    directories (never the one ``latest`` names). Called after a save has been marked latest, so a
    crash mid-save never leaves the run without a complete checkpoint. Each directory is renamed out of
    the ``global_step_<N>`` names first (one atomic step), then deleted: a deletion cut short (SIGTERM,
    a crash) never leaves a half-deleted directory that still looks complete; such leftovers
    (``.global_step_<N>.removing``) go at the next prune. Returns what was removed."""
    if keep is None:
        return []
    for left in Path(root).glob(".global_step_*.removing"):
        shutil.rmtree(left, ignore_errors=True)
    latest = _latest_step(root)
    steps = complete_steps(root)
    removed = []
    for step in steps[: max(0, len(steps) - keep)]:
        if step != latest:
            d = step_dir(root, step)
            gone = d.with_name(f".{d.name}.removing")
            os.replace(d, gone)
            shutil.rmtree(gone)
            removed.append(d)
    return removed


def read_trainer_state(d: Path) -> dict[str, Any]:
    return json.loads((d / "trainer_state.json").read_text())
