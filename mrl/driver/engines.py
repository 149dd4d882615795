"""The run's engine servers: where each one runs, its command line, and a Ray actor that launches
it on the node of the devices it uses (so multi-node runs start every engine next to its GPUs).

Colocated (verl's hybrid engine): engine ``i`` shares the devices of trainer ranks
``[i·tp, (i+1)·tp)`` and its actor sits in the bundle of the first of them. Separate: engines get
a placement group of their own (one bundle of ``tp`` GPUs per engine). On CUDA every GPU of the
node stays visible to the engine and ``--base-gpu-id`` names its first one, so device indices
agree between trainer and engine (CUDA IPC handles of the tensor transport rely on that).

An SGLang engine wider than a node (``engine_tp_size = k · n_gpus_per_node``, separate only:
config/validate_engines.py) gets ``k`` whole-node bundles on ``k`` distinct nodes (``STRICT_SPREAD``).
SGLang runs once per node with ``--nnodes k --node-rank r --dist-init-addr <node-rank 0's ip>:<port>``,
each process owned by a launcher actor on its node; node-rank 0 serves the API (the engine's URL), the
others only SGLang's /health. ``RemoteEngine`` starts, waits for, restarts and stops all of them
together (docs/driver.md, 'Engines over several nodes').
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrl.config import MRLConfig
from mrl.config.layout import engine_nodes
from mrl.config.run_plan import RunPlan
from mrl.errors import UnsupportedConfigError
from mrl.net import is_loopback

TOKEN_ENV = "MRL_ENGINE_TOKEN"


@dataclass(frozen=True)
class EngineNode:
    """One more node of an engine over several nodes: its SGLang node rank, where it is and its GPUs."""

    node_rank: int
    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...]
    bundle: int     # its launcher actor's bundle in the engines' placement group


@dataclass(frozen=True)
class EngineSlot:
    """One engine: its index, the node it runs on and the node-local GPU ids it uses (empty on CPU).
    An engine over several nodes: that is node-rank 0 (it serves ``url``), ``followers`` are node ranks
    1.. and ``dist_init_port`` the rendezvous port on node-rank 0 (``--dist-init-addr node_ip:port``)."""

    index: int
    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...]
    bundle: int     # bundle index in the placement group the engine's actor is scheduled into
    url: str
    port: int
    followers: tuple[EngineNode, ...] = ()
    dist_init_port: int | None = None

    @property
    def nnodes(self) -> int:
        return 1 + len(self.followers)

    @property
    def nodes(self) -> tuple[EngineNode, ...]:
        """Every node of the engine, node-rank 0 first."""
        return (EngineNode(0, self.node_id, self.node_ip, self.gpu_ids, self.bundle), *self.followers)


def plan_engines(cfg: MRLConfig, infos: list[dict[str, Any]], n_engines: int) -> list[EngineSlot]:
    """Slots for ``n_engines`` engines over ``infos`` (``_RankActor.node_info`` of the devices they
    use: the trainer ranks when colocated, the engines' own bundles when separate)."""
    r, tp = cfg.rollout, cfg.rollout.engine_tp_size
    colocated = r.placement == "colocated"
    spans = engine_nodes(cfg)
    if spans > 1:
        return _plan_multinode_engines(cfg, infos, n_engines, spans)
    per_engine = tp if colocated else 1  # separate: one bundle holds an engine's tp GPUs
    if len(infos) < n_engines * per_engine:
        raise UnsupportedConfigError(f"{n_engines} engines of rollout.engine_tp_size={tp} need "
                                     f"{n_engines * per_engine} device slots, the run has {len(infos)}")
    nodes = {i["node_id"] for i in infos}
    if len(nodes) > 1 and is_loopback(r.host):
        raise UnsupportedConfigError(
            f"rollout.host={r.host} is loopback but the run spans {len(nodes)} nodes: the driver cannot reach "
            "engines on other nodes; fix: rollout.host=0.0.0.0 (engines then require the per-run token mrl generates)")
    slots = []
    for i in range(n_engines):
        members = infos[i * per_engine:(i + 1) * per_engine]
        if len({m["node_id"] for m in members}) != 1:
            raise UnsupportedConfigError(
                f"engine {i} would span nodes (ranks {i * tp}..{(i + 1) * tp - 1}); fix: rollout.engine_tp_size "
                "dividing cluster.n_gpus_per_node so each engine's devices share one node")
        gpus = tuple(g for m in members for g in m["gpu_ids"])
        if gpus and list(gpus) != list(range(gpus[0], gpus[0] + len(gpus))):
            raise UnsupportedConfigError(
                f"engine {i}: its devices have GPU ids {list(gpus)}, not consecutive (SGLang takes --base-gpu-id "
                "and the next tp-1 GPUs); fix: give Ray whole nodes (cluster.n_gpus_per_node = GPUs per node)")
        host = members[0]["ip"] if r.host in ("0.0.0.0", "::") else r.host
        port = r.port_base + i
        slots.append(EngineSlot(i, members[0]["node_id"], members[0]["ip"], gpus, i * per_engine,
                                f"http://{host}:{port}", port))
    return slots


def _plan_multinode_engines(cfg: MRLConfig, infos: list[dict[str, Any]], n_engines: int, spans: int
                            ) -> list[EngineSlot]:
    """Slots of engines over ``spans`` whole nodes each (separate placement, validated by config): engine i takes
    bundles ``[i·spans, (i+1)·spans)``, one per node, the first being node-rank 0."""
    r, per_node = cfg.rollout, cfg.cluster.n_gpus_per_node
    if r.placement != "separate":  # engine_nodes > 1 only for SGLang
        raise UnsupportedConfigError(f"rollout.engine_tp_size={r.engine_tp_size} spans {spans} nodes, which only "
                                     "rollout.engine=sglang with rollout.placement=separate does; fix: those, or "
                                     f"rollout.engine_tp_size<={per_node}")
    if len(infos) < n_engines * spans:
        raise UnsupportedConfigError(f"{n_engines} engines over {spans} nodes each need {n_engines * spans} whole-node "
                                     f"bundles, the engines' placement has {len(infos)}")
    if r.host not in ("0.0.0.0", "::"):
        raise UnsupportedConfigError(f"rollout.host={r.host}: an engine over {spans} nodes binds it on each of them; "
                                     "fix: rollout.host=0.0.0.0")
    slots = []
    for i in range(n_engines):
        members = infos[i * spans:(i + 1) * spans]
        if len({m["node_id"] for m in members}) != spans:
            raise UnsupportedConfigError(
                f"engine {i}: its {spans} bundles landed on nodes {[m['ip'] for m in members]}, not {spans} distinct "
                f"nodes; fix: cluster.n_gpus_per_node = the GPUs of one node (each bundle is a whole node)")
        for m in members:
            gpus = list(m["gpu_ids"])
            if not gpus or gpus != list(range(gpus[0], gpus[0] + per_node)):
                raise UnsupportedConfigError(
                    f"engine {i}: its bundle on {m['ip']} has GPU ids {gpus}, not {per_node} consecutive ones (SGLang "
                    "takes --base-gpu-id and the next GPUs of each node); fix: cluster.n_gpus_per_node = GPUs per node")
        head = members[0]
        port = r.port_base + i
        nodes = [EngineNode(k, m["node_id"], m["ip"], tuple(m["gpu_ids"]), i * spans + k) for k, m in enumerate(members)]
        slots.append(EngineSlot(i, head["node_id"], head["ip"], nodes[0].gpu_ids, i * spans, f"http://{head['ip']}:{port}",
                                port, followers=tuple(nodes[1:]), dist_init_port=int(head["free_port"])))
    return slots


def spans_nodes(slots: list[EngineSlot], rank_infos: list[dict[str, Any]]) -> bool:
    """Whether the trainer ranks and every node of every engine are on more than one node: the trainer's source
    ranks then reach the engines' ranks (a weight-sync group) only through a routable address, not loopback."""
    return len({n.node_id for s in slots for n in s.nodes} | {i["node_id"] for i in rank_infos}) > 1


def engine_bundle_info() -> dict[str, Any]:
    """``placement_info`` of an engine bundle plus a port free on its node (all interfaces): node-rank 0's
    becomes an engine's ``--dist-init-addr`` port, as rank 0's free port becomes the trainer's MASTER_PORT."""
    from mrl.cluster.worker_group import placement_info
    from mrl.net import free_port

    return {**placement_info(), "free_port": free_port("0.0.0.0")}


def run_token(cfg: MRLConfig) -> str | None:
    """A fresh per-run control token for every engine, loopback included: any local process (another
    user's, a notebook) could otherwise pause the engines or load weights from disk into them. Both
    engines guard only their control endpoints with it (the embedded engine's token; SGLang's
    ``--admin-api-key``), so /generate and /health stay open and a router needs no key."""
    return secrets.token_urlsafe(32)


def engine_command(cfg: MRLConfig, slot: EngineSlot, token: str | None, *, dtype: str,
                   node_rank: int = 0) -> tuple[list[str], dict[str, str]]:
    """(argv, extra env) of ``slot``'s server: ``mrl.rollout.engine.server`` (torch) or SGLang's launch_server,
    in ``dtype``: the run plan's (model.dtype, null resolved for the device), the trainer ranks' dtype.
    ``node_rank``: which node's process of an engine over several nodes (``slot.nodes[node_rank]``)."""
    from mrl.rollout.sglang_launcher import (
        SGLangLaunchSpec,
        build_embedded_command,
        build_sglang_command,
    )

    r = cfg.rollout
    cuda = bool(slot.gpu_ids)
    if r.engine == "sglang":
        if not cuda:
            raise UnsupportedConfigError(f"rollout.engine=sglang: engine {slot.index} was placed without GPUs; "
                                         "fix: cluster.device=cuda")
        node = slot.nodes[node_rank]
        head = slot.node_ip if ":" not in slot.node_ip else f"[{slot.node_ip}]"  # an IPv6 address in ip:port
        # SGLang's --admin-api-key is an argv flag (visible in ps to users of the node); it has no env form.
        return build_sglang_command(SGLangLaunchSpec(
            model_path=cfg.model.path, port=slot.port, host=r.host, tp_size=r.engine_tp_size,
            mem_fraction_static=r.mem_fraction_static, colocated=r.placement == "colocated",
            base_gpu_id=node.gpu_ids[0], dtype=dtype, random_seed=cfg.trainer.seed + slot.index,
            admin_api_key=token, enable_return_routed_experts=cfg.actor.moe.engine_routed_experts,
            nnodes=slot.nnodes, node_rank=node_rank,
            dist_init_addr=f"{head}:{slot.dist_init_port}" if slot.nnodes > 1 else None,
            extra_args=[] if r.max_num_seqs is None else
            ["--max-running-requests", str(r.max_num_seqs)])), {}
    if slot.nnodes > 1:
        raise UnsupportedConfigError(f"engine {slot.index} spans {slot.nnodes} nodes, which only rollout.engine=sglang "
                                     "does; fix: rollout.engine=sglang")
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if token:
        env[TOKEN_ENV] = token
    if cuda:  # the embedded engine is single-device: it sees only its GPU, as cuda:0
        env["CUDA_VISIBLE_DEVICES"] = str(slot.gpu_ids[0])
    cmd = build_embedded_command(cfg.model.path, slot.port, host=r.host, token_env=TOKEN_ENV if token else None,
                                 device="cuda" if cuda else "cpu", dtype=dtype,
                                 seed=cfg.trainer.seed + slot.index,
                                 enable_return_routed_experts=cfg.actor.moe.engine_routed_experts)
    if r.max_num_seqs is not None:
        cmd += ["--max-running", str(r.max_num_seqs)]
    return cmd, env


class EngineRestartError(RuntimeError):
    """A restart that failed, said in one line: engine index, url, why (the first line of the launcher's
    error and the last line of the engine's log) and where its log is."""

    def __init__(self, slot: EngineSlot, log_path: Path, error: BaseException) -> None:
        cause = getattr(error, "cause", None) or error  # a Ray task error carries the remote exception
        lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip() and not ln.startswith(" ")]
        why = type(cause).__name__ if not lines else lines[0]
        if len(lines) > 1 and lines[-1] != lines[0]:
            why += f" ... {lines[-1]}"
        super().__init__(f"restart of engine {slot.index} ({slot.url}) failed: {why[:600]} (log: {log_path})")


class InRankEngine:
    """Driver-side handle of an engine served from a trainer rank's process (``transport=inprocess``,
    ``TrainRank.start_engine``): up when that call returned, stopped by the rank's ``close``, never
    restarted on its own (it lives and dies with its rank)."""

    restart = None  # the pool takes it out of service if it stops answering; the rank's failure ends the run

    def __init__(self, url: str) -> None:
        self.url = url

    def wait_healthy(self) -> float:
        return 0.0

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class NodeLaunch:
    """What runs on one more node of an engine over several nodes (node rank >= 1)."""

    node: EngineNode
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    scheduling_strategy: Any


class _NodeProcess:
    """One node's server process, owned by a launcher actor (``EngineLauncher``, an ``EngineProcess``) on that
    node; ``url``: where that process answers /health (node-rank 0: the engine's API)."""

    def __init__(self, node_id: str, port: int, cmd: list[str], url: str, log_path: Path,
                 env: dict[str, str], startup_timeout_s: float, scheduling_strategy: Any, cuda: bool) -> None:
        from mrl.cluster.worker_group import ALL_GPUS_VISIBLE
        from mrl.rollout.sglang_launcher import make_engine_actor_class

        self.node_id, self.port, self.url, self.pid = node_id, port, url, None
        self.actor = make_engine_actor_class().options(
            scheduling_strategy=scheduling_strategy, runtime_env=ALL_GPUS_VISIBLE if cuda else None,
            max_concurrency=2,  # stop() must get through while a restart waits for health
        ).remote(cmd, url, str(log_path), env=env, startup_timeout_s=startup_timeout_s)


class RemoteEngine:
    """Driver-side handle of one engine server whose process a Ray actor (``EngineLauncher``, an
    ``EngineProcess``) owns on the slot's node; an engine over several nodes has one such process and actor
    per node (``followers``: node ranks 1..), started, waited for, restarted and stopped together. Every call
    waits with a timeout; ``stop`` ends the servers, then the actors."""

    def __init__(self, slot: EngineSlot, cmd: list[str], env: dict[str, str], log_path: Path,
                 startup_timeout_s: float, scheduling_strategy: Any, cuda: bool,
                 followers: tuple[NodeLaunch, ...] = ()) -> None:
        import ray

        self._ray = ray
        self.slot, self.url, self.log_path = slot, slot.url, log_path
        self._startup_timeout_s = startup_timeout_s
        self._procs = [_NodeProcess(slot.node_id, slot.port, cmd, slot.url, log_path, env, startup_timeout_s,
                                    scheduling_strategy, cuda)]
        for f in followers:  # its health server listens on the engine's port on its own node
            self._procs.append(_NodeProcess(f.node.node_id, slot.port, f.cmd, f"http://{f.node.node_ip}:{slot.port}",
                                            f.log_path, f.env, startup_timeout_s, f.scheduling_strategy, cuda))

    @property
    def pid(self) -> int | None:
        """Node-rank 0's server (the one serving the API)."""
        return self._procs[0].pid

    def _call(self, method: str, timeout_s: float, *args: Any) -> Any:
        return self._ray.get(getattr(self._procs[0].actor, method).remote(*args), timeout=timeout_s)

    def _on_all(self, method: str, timeout_s: float, *args: Any, procs: list[_NodeProcess] | None = None) -> list[Any]:
        """``method`` on every node's actor at once; the first failure raises as soon as it is known (a node that
        died while the others wait for it), the whole call within ``timeout_s``."""
        import time

        procs = self._procs if procs is None else procs
        refs = [getattr(p.actor, method).remote(*args) for p in procs]
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = self._ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise TimeoutError(f"engine {self.slot.index} ({self.url}): {method} did not return on every node "
                                   f"within {timeout_s:.0f}s")
            self._ray.get(ready[0])  # raises that node's error now
        return self._ray.get(refs)

    def _start_all(self) -> None:
        self._on_all("start", 120.0, False)
        for p, pid in zip(self._procs, self._on_all("get_pid", 30.0)):
            p.pid = pid

    def start(self) -> None:
        self._start_all()

    def wait_healthy(self) -> float:
        """Seconds node-rank 0 took to answer /health (it does once every node's ranks have joined)."""
        return self._on_all("wait_healthy", self._startup_timeout_s + 60.0)[0]

    def restart(self) -> None:
        """The pool's restart callback: same nodes, same commands, same url; an engine over several nodes
        restarts on all of them (its TP ranks form one group: a new node-rank 0 cannot rejoin old followers). A
        failure is one line (the launcher's reason and the last line of the engine's log), not Ray's remote
        traceback: it becomes the engine's ``last_error``, which the run's stop message quotes."""
        try:
            if len(self._procs) == 1:
                self._call("restart", self._startup_timeout_s + 120.0)
                self._procs[0].pid = self._call("get_pid", 30.0)
                return
            self._stop_servers()
            self._start_all()
            self.wait_healthy()
        except Exception as e:  # noqa: BLE001 - any failure: the engine stays out, the reason kept short
            raise EngineRestartError(self.slot, self.log_path, e) from None

    def kill(self) -> None:
        """SIGKILL node-rank 0's server (a crash, for tests and fault handling)."""
        self._call("kill", 60.0)

    def log_tail(self, lines: int = 40) -> str:
        return self._call("log_tail", 30.0, lines)

    def _stop_servers(self) -> list[tuple[_NodeProcess, Exception]]:
        """Stop node-rank 0 first (SGLang's other nodes take their shutdown from it), then the others at once;
        returns the nodes whose actor failed to stop its server, with the error."""
        import time

        failed: list[tuple[_NodeProcess, Exception]] = []
        for group in (self._procs[:1], self._procs[1:]):
            refs, deadline = [(p, p.actor.stop.remote()) for p in group], time.monotonic() + 60.0
            for p, ref in refs:
                try:
                    self._ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
                except Exception as e:  # noqa: BLE001 - stop the others anyway
                    failed.append((p, e))
        return failed

    def stop(self) -> None:
        """Stop every node's server through its actor; where that fails (a stuck or dead actor) and the server
        runs on this node, kill its process group from here, so no server outlives the run."""
        try:
            failed = self._stop_servers()
            unkilled = [e for p, e in failed if not self._kill_local(p)]
            if unkilled:
                raise unkilled[0]
        finally:
            for p in self._procs:
                self._ray.kill(p.actor)

    def _kill_local(self, p: _NodeProcess) -> bool:
        """SIGKILL ``p``'s process group if it is on the driver's node and still this server."""
        import os
        import signal

        if p.pid is None or p.node_id != self._ray.get_runtime_context().get_node_id():
            return False
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:  # the pid may have been reused
                if str(p.port).encode() not in f.read():
                    return True
            os.killpg(p.pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass  # already gone
        return True


def _separate_placement(cfg: MRLConfig, cuda: bool, n: int, timeout_s: float = 600.0
                        ) -> tuple[Any, list[dict[str, Any]]]:
    """A placement group of the ``n`` engines' bundles and where they landed (``engine_bundle_info`` of each):
    one bundle of ``tp`` GPUs per engine, or for engines over ``k`` nodes ``k`` whole-node bundles each, every
    bundle on a node of its own (``STRICT_SPREAD``: two of one engine never share a node)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from mrl.cluster.worker_group import ALL_GPUS_VISIBLE

    spans = engine_nodes(cfg) if cuda else 1
    gpus = cfg.cluster.n_gpus_per_node if spans > 1 else cfg.rollout.engine_tp_size
    bundle = {"CPU": 1, **({"GPU": gpus} if cuda else {})}
    count = n * spans
    pg = placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_SPREAD" if spans > 1 else "PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        what = f"{n} separate engines with {bundle} each" if spans == 1 else \
            f"{n} separate engines over {spans} nodes each ({count} nodes with {bundle} free)"
        raise UnsupportedConfigError(f"Ray could not place {what} within {timeout_s:.0f}s; fix: lower "
                                     "rollout.num_engines or add devices") from None

    probe = ray.remote(engine_bundle_info)
    refs = [probe.options(num_cpus=0.01, num_gpus=gpus if cuda else 0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i), runtime_env=ALL_GPUS_VISIBLE if cuda else None).remote()
        for i in range(count)]
    return pg, ray.get(refs, timeout=timeout_s)


class EngineSet:
    """The run's engines: started next to their devices, stopped (servers, actors, placement) on ``stop``."""

    def __init__(self, cfg: MRLConfig, plan: RunPlan, workers: Any) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r = cfg.rollout
        n = max(1, plan.num_engines)
        self.token = run_token(cfg)
        self.own_pg = None
        if r.placement == "colocated":
            pg, infos = workers.pg, workers.infos
        else:
            pg, infos = _separate_placement(cfg, plan.device == "cuda", n)
            self.own_pg = pg
        self.slots = plan_engines(cfg, infos, n)
        self.remote_nodes = spans_nodes(self.slots, workers.infos)
        self.engines: list[RemoteEngine | InRankEngine] = []
        if plan.transport == "inprocess":  # engine r runs inside trainer rank r (config-checked layout)
            workers.wait_constructed()
            from mrl.driver.ranks import TrainRanks

            TrainRanks(workers).start_engine([s.url for s in self.slots], self.token)
            self.engines = [InRankEngine(s.url) for s in self.slots]
            return
        try:
            for slot in self.slots:
                cmd, env = engine_command(cfg, slot, self.token, dtype=plan.dtype)
                strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=slot.bundle)
                # absolute: the actor's working directory is Ray's choice, not the driver's
                log = plan.log_dir.resolve() / f"engine_{slot.index}.log"
                followers = tuple(NodeLaunch(
                    node, *engine_command(cfg, slot, self.token, dtype=plan.dtype, node_rank=node.node_rank),
                    log.with_name(f"engine_{slot.index}_node{node.node_rank}.log"),
                    PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=node.bundle))
                    for node in slot.followers)
                e = RemoteEngine(slot, cmd, env, log, r.engine_startup_timeout_s, strategy, cuda=bool(slot.gpu_ids),
                                 followers=followers)
                self.engines.append(e)
                e.start()
        except BaseException:
            self.stop()  # the caller never gets this set to stop: the ones already started go now
            raise

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def wait_healthy(self) -> None:
        for e in self.engines:
            e.wait_healthy()

    def stop(self) -> list[str]:
        """Stop every server (before Ray shuts down: the servers run in their own sessions and would
        outlive their actors); returns the errors met, one line each."""
        errors = []
        for e in self.engines:
            try:
                e.stop()
            except Exception as ex:  # noqa: BLE001 - stop the others anyway
                errors.append(f"engine {e.url}: {ex}")
        self.engines = []
        if self.own_pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.own_pg)
            self.own_pg = None
        return errors
