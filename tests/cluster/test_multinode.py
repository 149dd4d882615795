"""Ranks on two Ray nodes (two raylets on this host, ``ray.cluster_utils.Cluster``) find each other:
MASTER_ADDR/PORT from rank 0's node, per-node LOCAL_RANK/NODE_RANK, and a gloo all-reduce across them."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("ray")


class GlooProbe:
    def __init__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        self.env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR")}

    def all_reduce(self) -> tuple[dict, float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(int(self.env["RANK"]) + 1)])
        dist.all_reduce(t)
        return self.env, float(t)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def test_ranks_on_two_nodes_rendezvous() -> None:
    import ray
    from ray.cluster_utils import Cluster

    from mrl.cluster import WorkerGroup

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address)
        g = WorkerGroup(f"{__name__}.GlooProbe", {}, world_size=2, device="cpu", timeout_s=120)
        try:
            out = g.execute_all("all_reduce")
            assert [o[1] for o in out] == [3.0, 3.0]
            assert len({i["node_id"] for i in g.infos}) == 2  # one CPU per node: the ranks were spread
            assert [o[0]["NODE_RANK"] for o in out] == ["0", "1"]
            assert [o[0]["LOCAL_RANK"] for o in out] == ["0", "0"]
            assert {o[0]["MASTER_ADDR"] for o in out} == {g.infos[0]["ip"]}  # not loopback across nodes
        finally:
            g.close("close", timeout_s=30)
    finally:
        ray.shutdown()
        cluster.shutdown()
