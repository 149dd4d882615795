"""Faults injected into a small real run (issue 33): SIGKILL of an engine server (the pool restarts it,
re-syncs the actor's weights and the run goes on; or, when the restart fails, the run stops naming the
engine), and SIGKILL of a trainer rank (the run stops naming the rank and the last resumable checkpoint,
and nothing of it is left running; also when the engines live in the ranks, where the surviving rank's
collective often fails before Ray reports the death). Each fault comes once checkpoint 1 is complete; where in step 2 it
lands does not change the outcome asserted. The engine faults join the test session's Ray instance (the
engine is found by its port); the rank faults start their own, whose whole process tree they check."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from mrl.megatron.checkpoint import verify_checkpoint
from tests.helpers.e2e import free_port_pair, write_assets
from tests.helpers.faults import (
    finish,
    kill_engine,
    kill_one,
    left_running,
    ports_released,
    shm_of,
    start_train,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_assets(tmp_path_factory.mktemp("faults"))


@pytest.fixture
def assets(assets_src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(assets_src, tmp_path / "assets"))  # a test may move the model away


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "actor is dead" not in err and "httpx" not in err, err[-4000:]


def test_a_killed_engine_is_restarted_with_the_actors_weights_and_the_run_goes_on(assets: Path, tmp_path: Path) -> None:
    # verify: after every push the sender compares each tensor's checksum on every engine with the
    # actor's, the restarted one included; samples must also carry the pushed weight version.
    port = free_port_pair()
    p = start_train(tmp_path, assets, port, "rollout.weight_sync.verify=true", join_ray=True)
    wait_for_checkpoint(p, tmp_path / "ckpt")
    kill_engine(port)
    rc, err = finish(p, tmp_path)
    assert rc == 0, err[-6000:]
    _no_traceback(err)
    assert re.search(r"engine http://127\.0\.0\.1:\d+ taken out", err), err[-4000:]
    back = re.findall(r"engine (http://127\.0\.0\.1:\d+) back in service at weight version (\d+) \(restart #1\)", err)
    assert len(back) == 1 and int(back[0][1]) >= 2, err[-4000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"  # every step trained


def test_an_engine_that_cannot_be_restarted_stops_the_run_naming_it(assets: Path, tmp_path: Path) -> None:
    port = free_port_pair()
    p = start_train(tmp_path, assets, port, "rollout.engine_startup_timeout_s=60", join_ray=True)
    wait_for_checkpoint(p, tmp_path / "ckpt")
    (assets / "tiny-qwen2").rename(assets / "moved")  # the restart finds no model: it exits at once
    kill_engine(port)
    rc, err = finish(p, tmp_path, timeout_s=400)
    assert rc == 1, err[-6000:]
    _no_traceback(err)
    last = err.strip().splitlines()[-1]
    assert re.search(rf"mrl train: .*lost engine \d \(http://127\.0\.0\.1:({port}|{port + 1})\): recovery failed: "
                     r"EngineRestartError: restart of engine \d .* no config\.json", last), err[-4000:]


@pytest.mark.parametrize("transport", ["tensor", "inprocess"])  # inprocess: the CPU default, engines in the ranks
def test_a_killed_trainer_rank_stops_the_run_and_leaves_nothing_running(transport: str, assets: Path,
                                                                        tmp_path: Path) -> None:
    port = free_port_pair()
    p = start_train(tmp_path, assets, port, f"rollout.weight_sync.transport={transport}")
    wait_for_checkpoint(p, tmp_path / "ckpt")
    victim, procs = kill_one(p, "ray::_RankActor")
    rc, err = finish(p, tmp_path, timeout_s=300)
    assert rc == 1, err[-6000:]
    _no_traceback(err)
    last = err.strip().splitlines()[-1]
    step1 = tmp_path / "ckpt" / "global_step_1"
    assert re.search(rf"mrl train: TrainRank rank [01] \(pid {victim} .*\) died during \w+: its process exited", last), last
    assert f"last resumable checkpoint: {step1}" in last and "resumes from it" in last, last
    verify_checkpoint(step1 / "actor")  # whole, and what a resume loads
    assert left_running(procs) == []
    assert ports_released([port, port + 1]) == []
    assert shm_of(set(procs)) == []
