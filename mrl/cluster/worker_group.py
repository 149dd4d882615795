"""One Ray actor per trainer rank, all in one placement group, driven SPMD-style.

Every rank runs the same method on the same (full) arguments; collectives inside the workers
(gloo/NCCL) need all ranks to enter together, so :meth:`WorkerGroup.execute_all` always calls all
ranks and waits with a timeout (a rank that died or hangs surfaces as an error, never a hang).
"""
from __future__ import annotations

import importlib
import os
import secrets
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mrl.cluster.wire import register_tensor_wire
from mrl.net import free_port
from mrl.quiet_stop import quiet_stop_in_finalizers


class WorkerGroupError(RuntimeError):
    """A rank failed or did not answer within the timeout."""


class RankDiedError(WorkerGroupError):
    """A rank's process is gone (killed, out of memory, a crash in native code): ``rank`` and ``role`` (the
    rank's class) say which; the message is one line, not Ray's paragraph about possible causes."""

    def __init__(self, message: str, rank: int, role: str) -> None:
        super().__init__(message)
        self.rank, self.role = rank, role


def _died(e: ray.exceptions.RayError, rank: int, role: str, what: str) -> RankDiedError | None:
    """A RankDiedError when ``e`` says the rank's actor (its process) is dead, else None."""
    if not isinstance(e, ray.exceptions.RayActorError):
        return None
    import re

    text = str(e)
    pid = re.search(r"\bpid: (\d+)", text)
    ip = re.search(r"\bip: ([0-9a-fA-F.:]+)", text)
    where = f" (pid {pid.group(1)}{f' on {ip.group(1)}' if ip else ''})" if pid else ""
    return RankDiedError(f"{role} rank {rank}{where} died during {what}: its process exited (killed by a signal, "
                         "out of memory, or a crash in native code; see the kernel log and the run's worker logs)",
                         rank, role)


def init_ray(address: str | None, num_cpus: int | None = None) -> None:
    """Join ``address`` (cluster.address) or start a local Ray instance with ``num_cpus``.

    A local instance's GCS, raylet and workers listen on every interface of the host (Ray binds
    them to all addresses and turns a loopback node IP into the host's own; measured with Ray
    2.60), and a Ray cluster runs any code a client sends it. So unless ``RAY_AUTH_MODE`` is set
    in the environment, the local instance gets Ray's token authentication with a fresh random
    token that lives only in the environment of this run's processes (``RAY_AUTH_TOKEN``, not
    ``~/.ray/auth_token``, which a plain ``ray.init()`` would write): a client without it is
    refused (tests/cluster/test_ray_auth.py). A cluster joined by address keeps its own settings.
    Tensors the driver sends go as raw bytes (mrl/cluster/wire.py).
    """
    if not ray.is_initialized():
        if address:
            ray.init(address=address, log_to_driver=True)
        else:  # "local": a new instance even when another one runs on this host (plain ray.init() would join it)
            if "RAY_AUTH_MODE" not in os.environ:
                # Ray turns token mode on for a new local instance when the mode is unset (and refreshes
                # its cached config then; setting the mode here would not reach this process's client);
                # the token it finds in the environment is this run's, so it writes none to ~/.ray
                os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    register_tensor_wire()


# On CUDA every process we place keeps all of its node's GPUs visible (Ray would narrow
# CUDA_VISIBLE_DEVICES to its own): ranks select theirs by LOCAL_RANK, engines by --base-gpu-id, so
# device indices agree between trainer and engine and NCCL keeps P2P between ranks.
ALL_GPUS_VISIBLE = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}


def placement_info() -> dict[str, Any]:
    """Where the calling Ray task/actor runs: node id and IP, and the node-local GPU ids Ray gave it."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "gpu_ids": sorted(int(g) for g in ray.get_gpu_ids())}


def _resolve(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@ray.remote(max_concurrency=1)
class _RankActor:
    """Holds one rank's worker object. Synchronous: methods run one at a time. The object may define
    ``before_call()``, run before every method on the thread that runs it (the trainer rank re-enters
    its per-thread device set-up there); this layer knows nothing of what the object holds."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        quiet_stop_in_finalizers()  # ray.kill at the end of a run: no traceback on the driver's console
        register_tensor_wire()  # results (log-probs, values, ...) go back as raw bytes too
        self.obj: Any = None

    def node_info(self) -> dict[str, Any]:
        """Where this rank landed: Ray node id and IP, the node-local GPU ids Ray assigned it, and
        a free port on its node (rank 0's becomes MASTER_PORT)."""
        return {**placement_info(), "free_port": free_port(), "pid": os.getpid()}

    def construct(self, cls_path: str, kwargs: dict[str, Any], env: dict[str, str]) -> bool:
        os.environ.update(env)
        self.obj = _resolve(cls_path)(**kwargs)
        return True

    def call(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        before = getattr(self.obj, "before_call", None)
        if before is not None:
            before()
        return getattr(self.obj, method)(*args, **kwargs)


def rank_env(infos: list[dict[str, Any]], device: str) -> list[dict[str, str]]:
    """Per-rank rendezvous env from where the ranks landed (``_RankActor.node_info``).

    MASTER_ADDR/MASTER_PORT: a port free on rank 0's node, at 127.0.0.1 when every rank shares one
    node (nothing leaves the host) and at rank 0's node IP otherwise (other nodes cannot reach the
    driver's loopback). LOCAL_RANK: on CUDA the node-local GPU index Ray assigned (every GPU of
    the node stays visible to the rank, see ``WorkerGroup``), so ``torch.cuda.set_device(LOCAL_RANK)``
    picks the rank's own GPU; on CPU the rank's position among the ranks on its node.
    NODE_RANK numbers the nodes in order of their first rank.
    """
    nodes: dict[str, list[int]] = {}
    for r, info in enumerate(infos):
        nodes.setdefault(info["node_id"], []).append(r)
    node_rank = {node: i for i, node in enumerate(nodes)}
    out = []
    for r, info in enumerate(infos):
        if device == "cuda":
            if len(info["gpu_ids"]) != 1:
                raise WorkerGroupError(f"rank {r} was given GPUs {info['gpu_ids']} by Ray; expected exactly one")
            local = info["gpu_ids"][0]
        else:
            local = nodes[info["node_id"]].index(r)
        out.append({"MASTER_ADDR": infos[0]["ip"] if len(nodes) > 1 else "127.0.0.1", "MASTER_PORT": str(infos[0]["free_port"]),
                    "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(len(nodes[info["node_id"]])),
                    "NODE_RANK": str(node_rank[info["node_id"]])})
    return out


class WorkerGroup:
    """``world_size`` rank actors with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/LOCAL_RANK set
    (``rank_env``: from where Ray placed them, so ranks on several nodes find rank 0).

    ``cls_path`` (``"pkg.module.Class"``) is constructed on every rank with ``kwargs``; the env is
    in place before the constructor runs (it calls ``init_parallel`` from env). Ranks are packed
    into one placement group bundle per rank (``cpus_per_rank`` CPUs, ``gpus_per_rank`` GPUs).
    """

    def __init__(self, cls_path: str, kwargs: dict[str, Any], *, world_size: int, device: str,
                 cpus_per_rank: float = 1.0, timeout_s: float = 600.0,
                 extra_env: dict[str, str] | None = None, wait: bool = True) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.role = cls_path.rsplit(".", 1)[-1]  # named in errors: which group's rank failed
        gpus = 1 if device == "cuda" else 0
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise WorkerGroupError(
                f"Ray could not place {world_size} ranks with {bundle} each within {timeout_s:.0f}s; "
                "fix: lower cluster.n_gpus_per_node or give Ray more CPUs (cluster.cpus_per_node)"
            ) from None
        self.actors = []
        runtime_env = ALL_GPUS_VISIBLE if gpus else None
        for r in range(world_size):
            env = {"RANK": str(r), "WORLD_SIZE": str(world_size), "MRL_DEVICE": device, **(extra_env or {})}
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=r)
            self.actors.append(_RankActor.options(
                num_cpus=cpus_per_rank, num_gpus=gpus, scheduling_strategy=strategy, runtime_env=runtime_env,
            ).remote(env))
        self.infos = self._wait([a.node_info.remote() for a in self.actors], "node_info")
        envs = rank_env(self.infos, device)
        self._construct = [a.construct.remote(cls_path, kwargs, e) for a, e in zip(self.actors, envs)]
        if wait:
            self.wait_constructed()

    def wait_constructed(self) -> None:
        """Block until every rank's worker object is built (``wait=False`` lets the caller start
        engines next to the ranks while the models load)."""
        if self._construct:
            refs, self._construct = self._construct, []
            self._wait(refs, "construct")

    def _wait(self, refs: list, what: str, timeout_s: float | None = None) -> list[Any]:
        """All ranks' results, failing as soon as ONE rank fails: its peers may then be blocked in a
        collective that never completes, and waiting for them would turn one error into a hang."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorkerGroupError(f"{what}: not every rank answered within {timeout:.0f}s")
            try:
                ray.get(ready[0])
            except ray.exceptions.RayError as e:
                rank = refs.index(ready[0])
                died = _died(e, rank, self.role, what) or self._peer_died(refs, pending, what)
                if died is not None:
                    raise died from None
                raise WorkerGroupError(f"{what} failed on rank {rank}: {e}") from e
        return ray.get(refs)

    def _peer_died(self, refs: list, pending: list, what: str, grace_s: float = 2.0) -> RankDiedError | None:
        """A rank's failure is often its peer's death seen from a collective (gloo: connection closed by
        peer) before Ray reports the dead actor (well under a second after the process exits): give the
        other ranks ``grace_s`` to show it, so the error names the rank that died, not the one that noticed."""
        deadline = time.monotonic() + grace_s
        pending = list(pending)
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    died = _died(e, refs.index(ref), self.role, what)
                    if died is not None:
                        return died
        return None

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every rank; per-rank results in rank order."""
        refs = [a.call.remote(method, args, kwargs) for a in self.actors]
        return self._wait(refs, f"{method}")

    def close(self, method: str = "close", timeout_s: float = 30.0) -> None:
        """Teardown: ``method`` on every rank within ``timeout_s`` (a rank still stuck in a failed
        step's collective cannot answer; :meth:`shutdown` kills it next), then :meth:`shutdown`."""
        try:
            # every live rank gets its close (a sender unlinks its /dev/shm segment there), a dead one is
            # skipped: it was reported by the call it failed
            refs = [a.call.remote(method, (), {}) for a in self.actors]
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    pass
                except ray.exceptions.RayError as e:
                    raise WorkerGroupError(f"{method} failed on rank {refs.index(ref)}: {e}") from e
            if pending:
                raise WorkerGroupError(f"{method}: not every rank answered within {timeout_s:.0f}s")
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Kill every rank actor and release the placement group (idempotent)."""
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

