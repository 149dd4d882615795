"""A full disk during a checkpoint save and on the resume (issue 33: a 3 MB tmpfs gave a
CheckpointException traceback, then the resume an OSError traceback from the metrics log writer). The
checkpoint directory is a 5 MiB tmpfs in a private mount namespace (one checkpoint of the tiny model
takes 3 MiB), so every writer meets a real ENOSPC; needs root for the mount (skipped otherwise)."""
from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.e2e import ROOT, free_port_pair, write_assets

pytestmark = pytest.mark.slow


def _can_mount_tmpfs(d: Path) -> bool:
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f"mount -t tmpfs -o size=1m mrl-test '{d}'"], capture_output=True, timeout=30, check=False)
    return p.returncode == 0


def test_a_full_disk_at_a_save_keeps_the_previous_checkpoint_latest_and_is_reported_in_one_line(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if not _can_mount_tmpfs(mnt):
        pytest.skip("no private tmpfs here (unshare --mount + mount need root)")
    assets, out = write_assets(tmp_path), tmp_path / "out.json"
    script = f"mount -t tmpfs -o size=5m mrl-test '{mnt}' && exec \"$0\" -m tests.helpers.disk_full_scenario \"$@\""
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable, str(mnt),
                        str(assets), str(free_port_pair()), str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=2400, check=False)
    assert p.returncode == 0 and out.is_file(), p.stderr[-4000:]
    r = json.loads(out.read_text())

    save = r["save"]
    assert save["rc"] == 1, save["stderr"]
    last = save["stderr"].strip().splitlines()[-1]
    assert "Traceback" not in save["stderr"] and "CheckpointException" not in save["stderr"], save["stderr"]
    assert f"the checkpoint of step 2 did not fit in {mnt}/ckpt/global_step_2" in last, last
    assert "MiB free of 5.0 MiB on the filesystem of" in last, last
    assert f"the latest checkpoint is still {mnt}/ckpt/global_step_1" in last, last
    # the pointer never names the partial save, which was removed; the previous checkpoint loads
    assert r["latest"] == "1" and r["step_dirs"] == ["global_step_1"] and r["step1_verified"] is True, r

    assert r["filler_errno"] == errno.ENOSPC
    resume = r["resume_saving"]  # before Ray: the next save could not fit
    assert resume["rc"] == 1 and "Traceback" not in resume["stderr"], resume["stderr"]
    assert f"no room for the next checkpoint in trainer.default_local_dir={mnt}/ckpt" in resume["stderr"], resume
    assert "nothing was started" in resume["stderr"] and "Started a local Ray" not in resume["stderr"], resume

    logs = r["resume_not_saving"]  # the metrics log (or another of the driver's writers) on the full disk
    assert logs["rc"] == 1 and "Traceback" not in logs["stderr"] and "OSError" not in logs["stderr"], logs["stderr"]
    assert f"mrl train: no space left writing {mnt}/ckpt" in logs["stderr"], logs["stderr"]
