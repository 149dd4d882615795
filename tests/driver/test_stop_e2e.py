"""SIGTERM to a real `mrl train` (issue 53, item 5; mrl/driver/stop.py): the run stops within 30 s (Slurm's and
Kubernetes' grace before SIGKILL), exits 143 with one line naming the step and the last complete checkpoint, and
nothing it started runs on (checked by pid: the driver's children, Ray's daemons and workers, the engine servers);
the last complete checkpoint is whole and what a resume picks, and a save cut off leaves no checkpoint that looks
complete.

The phase is made long by a plugin that never returns until the stop (tests/helpers/blocking_plugin.py), not by
timing: the policy loss in the ranks' update of step 2 (held once step 1's trainer_state.json exists), or the
sampler's state in the first save. The signal goes when the plugin's marker file says the phase is held. The
update case signals the whole process group, as `timeout` and Slurm do: Ray's GCS and raylet get it too, which
made the old driver wait 60 s for its GCS and end on Ray's "Failed to connect to GCS" error."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from mrl.driver.state import complete_steps, find_resume_dir
from mrl.megatron.checkpoint import verify_checkpoint
from tests.helpers.e2e import ROOT, free_port_pair, write_assets
from tests.helpers.faults import (
    descendants,
    left_running,
    ports_released,
    shm_of,
    start_train,
)

pytestmark = pytest.mark.slow

PLUGIN = ROOT / "tests" / "helpers" / "blocking_plugin.py"
BUDGET_S = 30.0  # SIGTERM -> SIGKILL under Slurm and Kubernetes


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_assets(tmp_path_factory.mktemp("stop"))


def _start_held(tmp: Path, assets: Path, monkeypatch: pytest.MonkeyPatch, flag: str, after: str = ""):
    """The run with the blocking plugin, ``flag`` set (held once ``after`` exists); (process, marker glob, port)."""
    block = tmp / "block"
    block.mkdir()
    (block / flag).write_text(after)
    monkeypatch.setenv("MRL_BLOCK_DIR", str(block))  # the driver's environment: its own Ray's workers inherit it
    port = free_port_pair()
    p = start_train(tmp, assets, port, f"actor.policy_loss={PLUGIN}:blocking_vanilla",
                    f"data.sampler.class_path={PLUGIN}:blocking_resumable")
    return p, block, port


def _wait_held(p, block: Path, pattern: str, tmp: Path, timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(block.glob(pattern)):
        assert p.poll() is None, f"the run ended (rc {p.returncode}): {(tmp / 'stderr.txt').read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"the phase was not reached within {timeout_s}s"
        time.sleep(0.05)


def _stop(p, tmp: Path, *, group: bool) -> tuple[int, float, str, dict[int, str]]:
    """SIGTERM (to the driver, or its whole process group); (exit code, seconds to exit, stderr, the run's processes
    just before the signal)."""
    procs = descendants(p.pid)
    t0 = time.monotonic()
    (os.killpg if group else os.kill)(p.pid, signal.SIGTERM)
    try:
        rc = p.wait(timeout=120)
    except Exception:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    return rc, time.monotonic() - t0, (tmp / "stderr.txt").read_text(), procs


def _check_nothing_left(procs: dict[int, str], port: int) -> None:
    kinds = " ".join(procs.values())
    # what the run had started when it was stopped: Ray's daemons, rank workers, the engine servers
    assert "gcs_server" in kinds and "raylet" in kinds and "_RankActor" in kinds and "mrl.rollout.engine.server" in kinds
    assert left_running(procs, timeout_s=0.0) == []  # gone when the driver exited (zombies count as gone)
    assert ports_released([port, port + 1], timeout_s=5.0) == []  # the engines' ports
    assert shm_of(set(procs)) == []  # no weight sender's /dev/shm segment


def test_sigterm_to_the_process_group_in_a_long_update(assets: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "ckpt"
    p, block, port = _start_held(tmp_path, assets, monkeypatch, "block_update",
                                 after=str(ckpt / "global_step_1" / "trainer_state.json"))
    _wait_held(p, block, "update_blocked.*", tmp_path)  # step 2's update, in the ranks
    rc, took, err, procs = _stop(p, tmp_path, group=True)
    print(f"\nstopped {took:.1f} s after SIGTERM (exit {rc})")
    assert rc == 128 + signal.SIGTERM, err[-4000:]
    assert took < BUDGET_S, err[-4000:]
    assert err.strip().splitlines()[-1] == (f"mrl train: stopped by SIGTERM at step 2; last complete checkpoint: "
                                            f"{ckpt / 'global_step_1'}"), err[-4000:]
    assert "Traceback" not in err and "Failed to connect to GCS" not in err, err[-4000:]
    _check_nothing_left(procs, port)
    assert complete_steps(ckpt) == [1] and find_resume_dir(str(ckpt), "auto") == ckpt / "global_step_1"
    verify_checkpoint(ckpt / "global_step_1" / "actor")  # whole: every shard's checksum, its metadata


def test_sigterm_in_a_save_leaves_no_checkpoint_that_looks_complete(assets: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "ckpt"
    p, block, port = _start_held(tmp_path, assets, monkeypatch, "block_save")
    _wait_held(p, block, "save_blocked", tmp_path)  # step 1's save: the actor is written, its trainer state not
    assert (ckpt / "global_step_1" / "actor").is_dir()
    rc, took, err, procs = _stop(p, tmp_path, group=False)
    print(f"\nstopped {took:.1f} s after SIGTERM (exit {rc})")
    assert rc == 128 + signal.SIGTERM, err[-4000:]
    assert took < BUDGET_S, err[-4000:]
    assert err.strip().splitlines()[-1] == "mrl train: stopped by SIGTERM at step 1; no checkpoint was saved", err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    _check_nothing_left(procs, port)
    assert not (ckpt / "global_step_1" / "trainer_state.json").exists()
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()
    assert complete_steps(ckpt) == [] and find_resume_dir(str(ckpt), "auto") is None  # a new run starts fresh
