"""Trainer-state files and resume_mode resolution."""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.driver.state import (
    complete_steps,
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


def test_unreadable_latest_falls_back_to_newest_complete_checkpoint(tmp_path, caplog) -> None:
    # issue 19: an empty latest_checkpointed_iteration.txt blocked every resume (int('') ValueError)
    write_trainer_state(tmp_path, 2, {})
    write_trainer_state(tmp_path, 4, {})
    (tmp_path / "global_step_6" / "actor").mkdir(parents=True)  # half-written: ranks were still saving
    latest = tmp_path / "latest_checkpointed_iteration.txt"
    for content in ("", "garbage", "6", "9"):
        latest.write_text(content)
        with caplog.at_level("WARNING", logger="mrl.driver"):
            caplog.clear()
            assert find_resume_dir(str(tmp_path), "auto") == step_dir(tmp_path, 4), content
        assert "newest complete checkpoint" in caplog.text and "global_step_4" in caplog.text
    latest.unlink()
    assert find_resume_dir(str(tmp_path), "auto") == step_dir(tmp_path, 4)
    assert prune_checkpoints(tmp_path, 1) == [step_dir(tmp_path, 2)]  # the half-written 6 is never "complete"


def test_state_files_are_written_atomically(tmp_path, monkeypatch) -> None:
    write_trainer_state(tmp_path, 2, {"a": 1})
    import mrl.driver.state as st

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(st.os, "replace", crash)
    with pytest.raises(OSError):
        write_trainer_state(tmp_path, 4, {"a": 2})
    # the crash left the previous latest intact (an in-place write would have truncated it)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert find_resume_dir(str(tmp_path), "auto") == step_dir(tmp_path, 2)


def test_no_checkpoint_and_no_latest_is_a_fresh_start(tmp_path) -> None:
    (tmp_path / "global_step_3").mkdir()  # crashed before anything completed
    assert find_resume_dir(str(tmp_path), "auto") is None
    assert find_resume_dir(str(tmp_path / "missing"), "auto") is None


def test_a_prune_cut_short_leaves_no_half_deleted_checkpoint_that_looks_complete(tmp_path, monkeypatch) -> None:
    # SIGTERM (or a crash) in the middle of deleting an old checkpoint: the deletion got as far as the actor's
    # files; what is left must not be taken as a complete checkpoint (its trainer_state.json may be the last file
    # deleted), and the next prune removes it.
    import shutil

    import mrl.driver.state as st

    for step in (1, 2):
        (step_dir(tmp_path, step) / "actor").mkdir(parents=True)
        (step_dir(tmp_path, step) / "actor" / "shard.distcp").write_bytes(b"w" * 64)
        write_trainer_state(tmp_path, step, {})

    real_rmtree = shutil.rmtree

    def cut_short(path, *a, **k):
        real_rmtree(Path(path) / "actor")
        raise KeyboardInterrupt  # the signal, after the actor's files went and before trainer_state.json

    monkeypatch.setattr(st.shutil, "rmtree", cut_short)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(tmp_path, 1)
    assert complete_steps(tmp_path) == [2] and find_resume_dir(str(tmp_path), "auto") == step_dir(tmp_path, 2)
    monkeypatch.undo()
    assert prune_checkpoints(tmp_path, 1) == []  # nothing complete to prune; the leftover is swept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "latest_checkpointed_iteration.txt"]
