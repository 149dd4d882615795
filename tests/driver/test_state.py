"""Trainer-state files and resume_mode resolution."""
from __future__ import annotations

import pytest

from mrl.driver.state import (
    find_resume_dir,
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
