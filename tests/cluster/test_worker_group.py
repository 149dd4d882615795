"""WorkerGroup: env per rank before construction, rank-ordered results, errors and timeouts surface."""
from __future__ import annotations

import os
import time

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("ray")

from mrl.cluster import WorkerGroup, WorkerGroupError, init_ray


class EnvProbe:
    """Records the env it was constructed with (the workers call init_parallel from env)."""

    def __init__(self, tag: str) -> None:
        self.seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        self.tag = tag

    def info(self, x: int) -> tuple[dict, str, int]:
        return self.seen, self.tag, x * (int(self.seen["RANK"]) + 1)

    def fail_on_rank1(self) -> None:
        if self.seen["RANK"] == "1":
            raise ValueError("rank 1 broke")

    def sleep(self, s: float) -> None:
        time.sleep(s)

    def ping(self) -> str:
        return "pong"

    def fail_on_rank1_while_rank0_waits(self) -> None:
        """Rank 0 blocks as if in a collective its failed peer never joins."""
        if self.seen["RANK"] == "1":
            raise ValueError("rank 1 broke mid-step")
        time.sleep(20)


@pytest.fixture(scope="module")
def group():
    import ray

    init_ray(None, num_cpus=2)
    g = WorkerGroup(f"{__name__}.EnvProbe", {"tag": "t"}, world_size=2, device="cpu", timeout_s=60)
    yield g
    g.shutdown()
    ray.shutdown()


def test_env_and_rank_order(group) -> None:
    out = group.execute_all("info", 5)
    assert [o[2] for o in out] == [5, 10]
    assert [o[0]["RANK"] for o in out] == ["0", "1"]
    assert {o[0]["WORLD_SIZE"] for o in out} == {"2"}
    assert out[0][0]["MASTER_PORT"] == out[1][0]["MASTER_PORT"] and out[0][0]["MASTER_ADDR"] == "127.0.0.1"
    assert [o[1] for o in out] == ["t", "t"]


def test_rank_error_is_reported(group) -> None:
    with pytest.raises(WorkerGroupError, match="rank 1 broke"):
        group.execute_all("fail_on_rank1")


def test_timeout_does_not_hang(group) -> None:
    group.timeout_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError, match="within 1s"):
        group.execute_all("sleep", 5.0)
    assert time.monotonic() - t0 < 4.0
    group.timeout_s = 60.0


def test_one_failed_rank_fails_the_call_at_once(group) -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError, match="(?s)failed on rank 1: .*rank 1 broke mid-step"):
        group.execute_all("fail_on_rank1_while_rank0_waits")
    assert time.monotonic() - t0 < 10.0  # not the 20 s rank 0 is stuck for, nor the 60 s timeout
    # teardown of a group whose rank 0 is still stuck: bounded, then the actors are killed
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError, match="within 1s"):
        group.close("ping", timeout_s=1.0)
    assert time.monotonic() - t0 < 8.0 and group.actors == []
