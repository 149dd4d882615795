"""mrl/driver/disk_full.py without a full disk (the real one: test_disk_full_e2e.py, root only): which
errors are a full disk, what a failed save leaves, and the room check before a run starts."""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from mrl.driver.disk_full import check_room, checkpoint_save, is_disk_full
from mrl.driver.state import write_trainer_state
from mrl.errors import RunStoppedError


def _complete(root: Path, step: int, size: int = 1000) -> Path:
    d = root / f"global_step_{step}"
    (d / "actor").mkdir(parents=True)
    (d / "actor" / "shard.distcp").write_bytes(b"x" * size)
    write_trainer_state(root, step, {})
    return d


def test_out_of_space_errors_are_recognised_by_errno_and_by_a_remote_rank_s_text() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EFBIG, "File too large"))
    wrapped = RuntimeError("save failed on rank 1: ray::_RankActor.call() ... OSError: [Errno 28] No space left on device")
    assert is_disk_full(wrapped)
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("checkpoint failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(ValueError("tensor shapes differ"))


def test_a_save_that_ran_out_of_space_removes_only_the_partial_step_and_names_the_latest(tmp_path: Path) -> None:
    _complete(tmp_path, 1)
    partial = tmp_path / "global_step_2" / "actor"
    partial.mkdir(parents=True)
    (partial / "half.distcp").write_bytes(b"y" * 10)
    with pytest.raises(RunStoppedError) as e, checkpoint_save(str(tmp_path), 2):
        raise RuntimeError("OSError: [Errno 28] No space left on device")
    msg = str(e.value)
    assert f"the checkpoint of step 2 did not fit in {tmp_path / 'global_step_2'}" in msg
    assert f"the latest checkpoint is still {tmp_path / 'global_step_1'}" in msg and "MiB free of" in msg
    assert not (tmp_path / "global_step_2").exists() and (tmp_path / "global_step_1" / "trainer_state.json").is_file()
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert json.loads((tmp_path / "global_step_1" / "trainer_state.json").read_text())["global_step"] == 1


def test_other_save_errors_pass_through_and_leave_the_directory(tmp_path: Path) -> None:
    (tmp_path / "global_step_1").mkdir()
    with pytest.raises(ValueError, match="shapes differ"), checkpoint_save(str(tmp_path), 1):
        raise ValueError("shapes differ")
    assert (tmp_path / "global_step_1").is_dir()  # not ours to remove: the cause is not space


def test_a_run_that_would_checkpoint_needs_room_for_one_more(tmp_path: Path) -> None:
    latest = _complete(tmp_path, 3, size=1 << 20)
    check_room(str(tmp_path), 1, latest)  # this host has room for 1 MiB
    check_room(str(tmp_path), -1, latest)  # no checkpoints: nothing to need
    check_room(str(tmp_path), 1, None)  # nothing saved yet: size unknown
    huge = _complete(tmp_path / "big", 1)
    (huge / "actor" / "shard.distcp").unlink()
    size = shutil.disk_usage(tmp_path).free + (64 << 20)
    with (huge / "actor" / "sparse.distcp").open("wb") as f:  # larger than the free space, sparse: no disk used
        f.truncate(size)
    with pytest.raises(RunStoppedError, match=r"no room for the next checkpoint in trainer.default_local_dir=.*"
                                              r"takes \d+\.\d MiB, .* MiB free of .*nothing was started"):
        check_room(str(tmp_path / "big"), 1, huge)
