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

    def echo_tensors(self, ts: dict) -> tuple[dict, dict]:
        """The tensors back with a mark each (received tensors are writable and the rank's own), and
        how they arrived."""
        import torch

        seen = {k: (v.dtype, tuple(v.shape), v.is_contiguous(), v.requires_grad) for k, v in ts.items()}
        out = {}
        for k, v in ts.items():
            if v.requires_grad:
                out[k] = v
                continue
            v.view(-1)[:1] = torch.ones(1, dtype=v.dtype) if v.numel() else v.view(-1)[:1]  # in-place write
            out[k] = v
        return out, seen

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


def test_tensors_cross_ray_exactly_both_ways(group) -> None:
    """mrl/cluster/wire.py: every dtype bit for bit, shapes and strides, writable on arrival; tensors
    that need torch's own pickling (requires_grad) keep it."""
    import torch

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    ts = {"f32": base, "bf16": base.to(torch.bfloat16), "f16": base.half(), "f64": base.double(),
          "i64": torch.randint(-9, 9, (4, 3), generator=g), "i32": torch.arange(7, dtype=torch.int32),
          "u8": torch.arange(9, dtype=torch.uint8), "bool": base > 0, "c64": torch.complex(base, -base),
          "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "strided": base.t()[1:, ::2],
          "nan": torch.tensor([float("nan"), float("inf"), -0.0]), "grad": torch.ones(2, requires_grad=True)}
    out = group.execute_all("echo_tensors", ts)
    for back, seen in out:
        assert seen["strided"][2] is True and seen["grad"][3] is True  # contiguous copy; the flag kept
        for k, v in ts.items():
            assert seen[k][:2] == (v.dtype, tuple(v.shape)), k
            got, want = back[k], v.detach().clone()
            if want.numel() and not v.requires_grad:
                want.view(-1)[:1] = 1  # the rank's in-place mark came back
            assert got.dtype == want.dtype and got.shape == want.shape, k
            assert torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got,
                               want.contiguous().view(-1).view(torch.uint8) if want.numel() else want), k
    assert ts["f32"][0, 0] != 1  # the sender's tensor is untouched


def test_a_run_without_cluster_address_starts_its_own_ray_beside_a_running_cluster(tmp_path) -> None:
    # A cluster started on this host (as `ray start --head` does) is found by a plain ray.init(), which then
    # refused mrl's num_cpus ("When connecting to an existing cluster, num_cpus ... must not be provided"):
    # two runs or a user's own cluster on one host broke `mrl train`. Subprocesses: this process's Ray stays out.
    import subprocess
    import sys

    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        code = ("import ray; from mrl.cluster import init_ray; init_ray(None, num_cpus=2); "
                "print(ray.get_runtime_context().gcs_address, int(ray.cluster_resources()['CPU']))")
        out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=180,
                             env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        assert out.returncode == 0, out.stderr[-2000:]
        gcs, cpus = out.stdout.split()[-2:]
        assert gcs != cluster.address and cpus == "2"  # its own instance, with the CPUs it asked for
    finally:
        cluster.shutdown()
