"""A process group between one trainer rank and the engine ranks, outside the trainer's world.

Formed exactly the way SGLang's ``init_custom_process_group`` forms it on the engine side (TCP
rendezvous at ``master_address:master_port``, the store wrapped in ``PrefixStore(group_name, ·)``,
c10d's group helper), so the trainer (rank 0, the broadcast source) and every engine rank
(``rank_offset + tp_rank``) meet in one group: a store without that prefix never sees the engines'
keys and the rendezvous times out. gloo on CPU, NCCL on GPU. The trainer's default group is left
untouched. tests/rollout/conformance/ runs SGLang's own function on the other side.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank) a new group of ``world_size`` members; blocks until all have joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    # SGLang (every release since 0.4) prefixes the store with the group name: keys must meet.
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
    )
    # Register the group so torch.distributed collectives accept it (as SGLang does on the engine
    # side); callers pass ``group_src=`` (a group rank) so the identity map is never used to
    # translate this process's trainer rank.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: dist.ProcessGroup) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # noqa: BLE001, S110 - a group outside the default world may not be registered
        pass
