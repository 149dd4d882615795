"""Trainer-state files and resume_mode resolution."""
from __future__ import annotations

import pytest

from mrl.driver.state import (
    find_resume_dir,
    prune_checkpoints,
    read_trainer_state,
    step_dir,
    write_trainer_state,
)


def test_auto_finds_latest_and_roundtrips(tmp_path) -> None:
    assert find_resume_dir(str(tmp_path), "auto") is None
    write_trainer_state(tmp_path, 2, {"sampler": {"epoch": 0, "pos": 16}})
    write_trainer_state(tmp_path, 4, {"sampler": {"epoch": 1, "pos": 0}})
    d = find_resume_dir(str(tmp_path), "auto")
    assert d == step_dir(tmp_path, 4)
    assert read_trainer_state(d) == {"global_step": 4, "sampler": {"epoch": 1, "pos": 0}}
    assert find_resume_dir(str(tmp_path), "disable") is None
    assert find_resume_dir(str(tmp_path), str(step_dir(tmp_path, 2))) == step_dir(tmp_path, 2)


def test_explicit_path_must_exist(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="trainer.resume_mode"):
        find_resume_dir(str(tmp_path), str(tmp_path / "global_step_9"))


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path) -> None:
    for step in (2, 4, 6, 8):
        (step_dir(tmp_path, step) / "actor").mkdir(parents=True)
        write_trainer_state(tmp_path, step, {})
    (tmp_path / "global_step_10" / "actor").mkdir(parents=True)  # a save that crashed: no trainer_state.json
    (tmp_path / "notes").mkdir()
    assert prune_checkpoints(tmp_path, None) == []
    assert prune_checkpoints(tmp_path, 2) == [step_dir(tmp_path, 2), step_dir(tmp_path, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_10", "global_step_6", "global_step_8", "latest_checkpointed_iteration.txt", "notes"]
    assert find_resume_dir(str(tmp_path), "auto") == step_dir(tmp_path, 8)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("6")  # latest is never removed
    assert prune_checkpoints(tmp_path, 1) == []
