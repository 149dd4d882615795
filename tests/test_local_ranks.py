"""mrl's one local-rank launcher (mrl-ckpt and the test suite): results by rank and by value, the
first failure named by rank, a rank that dies or hangs never leaves the caller waiting."""
from __future__ import annotations

import os
import time

import pytest

from mrl.local_ranks import RankError, run_local_ranks


def _ok(rank: int, scale: int):
    import torch

    return {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "t": torch.full((2,), float(rank * scale)),
            "threads": os.environ.get("OMP_NUM_THREADS")}


def _fail_on_one(rank: int) -> int:
    if rank == 1:
        raise ValueError("bad shard 7")
    time.sleep(300)  # the others would wait in a collective: the failure must stop them
    return rank


def _die(rank: int) -> None:
    os._exit(9)


def _hang(rank: int) -> None:
    time.sleep(60)


def test_results_come_back_by_rank_and_by_value() -> None:
    out = run_local_ranks(_ok, 2, (3,), timeout_s=60, threads_per_rank=1)
    assert [o["rank"] for o in out] == [0, 1] and all(o["world"] == 2 and o["threads"] == "1" for o in out)
    assert out[1]["t"].tolist() == [3.0, 3.0]  # a tensor, read after its rank exited


def test_the_first_failure_names_its_rank_and_stops_the_others() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1: ValueError: bad shard 7") as e:
        run_local_ranks(_fail_on_one, 2, timeout_s=280)
    assert "Traceback" in e.value.details and time.monotonic() - t0 < 250  # not after the sleepers


def test_a_rank_that_dies_silently_is_reported() -> None:
    with pytest.raises(RankError, match="exit code 9"):
        run_local_ranks(_die, 2, timeout_s=50)


def test_a_hung_rank_hits_the_deadline_with_the_hint() -> None:
    with pytest.raises(TimeoutError, match="0/2 ranks finished within 3s; raise it"):
        run_local_ranks(_hang, 2, timeout_s=3, timeout_hint="; raise it")


def _env_and_parent(rank: int) -> dict:
    return {"v": os.environ.get("MRL_TEST_FORKSERVER_ENV"), "megatron_loaded": "megatron.core" in __import__("sys").modules,
            "ppid": os.getppid()}


def test_forkserver_ranks_get_the_callers_environment_and_a_single_threaded_server(monkeypatch) -> None:
    """The test suite's ranks are forks of a server that imported tests/helpers/dist.PRELOAD: forking is safe
    only if that import started no thread, and the ranks must see the caller's environment as it is now."""
    import multiprocessing.forkserver as fs

    from tests.helpers.dist import PRELOAD

    run_local_ranks(_env_and_parent, 1, timeout_s=120, preload=PRELOAD)  # starts the server if not yet running
    monkeypatch.setenv("MRL_TEST_FORKSERVER_ENV", "after-the-server-started")
    out = run_local_ranks(_env_and_parent, 2, timeout_s=60, preload=PRELOAD)
    server = fs._forkserver._forkserver_pid  # private, but the one handle on the server's process
    assert [o["v"] for o in out] == ["after-the-server-started"] * 2
    assert all(o["megatron_loaded"] and o["ppid"] == server for o in out)
    assert len(os.listdir(f"/proc/{server}/task")) == 1  # no thread the forks would lose mid-lock
