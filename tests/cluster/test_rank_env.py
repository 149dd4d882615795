"""rank_env: rendezvous env from where Ray placed the ranks (no Ray needed: pure function)."""
from __future__ import annotations

import pytest

pytest.importorskip("ray")

from mrl.cluster.worker_group import WorkerGroupError, rank_env


def _info(node: str, ip: str, gpus: list[int], port: int = 5000) -> dict:
    return {"node_id": node, "ip": ip, "gpu_ids": gpus, "free_port": port}


def test_single_node_cpu_uses_loopback_and_positions() -> None:
    env = rank_env([_info("a", "10.0.0.1", [], 4001), _info("a", "10.0.0.1", [], 4002)], "cpu")
    assert [e["MASTER_ADDR"] for e in env] == ["127.0.0.1"] * 2
    assert [e["MASTER_PORT"] for e in env] == ["4001"] * 2  # rank 0's port on rank 0's node
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1"]
    assert [e["NODE_RANK"] for e in env] == ["0", "0"] and env[0]["LOCAL_WORLD_SIZE"] == "2"


def test_two_nodes_cuda_local_rank_is_the_assigned_gpu() -> None:
    # Ray may hand out GPUs in any order; LOCAL_RANK must be the GPU index, not the rank position.
    infos = [_info("a", "10.0.0.1", [3]), _info("a", "10.0.0.1", [1]), _info("b", "10.0.0.2", [0]),
             _info("b", "10.0.0.2", [2])]
    env = rank_env(infos, "cuda")
    assert {e["MASTER_ADDR"] for e in env} == {"10.0.0.1"}
    assert [e["LOCAL_RANK"] for e in env] == ["3", "1", "0", "2"]
    assert [e["NODE_RANK"] for e in env] == ["0", "0", "1", "1"]


def test_interleaved_nodes_cpu_positions_per_node() -> None:
    infos = [_info("a", "1.1.1.1", []), _info("b", "2.2.2.2", []), _info("a", "1.1.1.1", [])]
    env = rank_env(infos, "cpu")
    assert [e["LOCAL_RANK"] for e in env] == ["0", "0", "1"]
    assert [e["LOCAL_WORLD_SIZE"] for e in env] == ["2", "1", "2"]


def test_cuda_rank_without_exactly_one_gpu_is_an_error() -> None:
    with pytest.raises(WorkerGroupError, match="rank 1 was given GPUs"):
        rank_env([_info("a", "1.1.1.1", [0]), _info("a", "1.1.1.1", [])], "cuda")
