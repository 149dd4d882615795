"""A process group between one trainer rank and the engine ranks, outside the trainer's world.

Formed the way SGLang's ``init_weights_update_group`` forms it on the engine side (TCP rendezvous
at ``master_address:master_port``, c10d's group helper with ``group_name`` as store prefix), so the
trainer (rank 0, the broadcast source) and every engine rank (``rank_offset + i``) meet in one
group. gloo on CPU, NCCL on GPU. The trainer's default group is left untouched.
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
