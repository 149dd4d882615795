"""The run's engine servers: where each one runs, its command line, and a Ray actor that launches
it on the node of the devices it uses (so multi-node runs start every engine next to its GPUs).

Colocated (verl's hybrid engine): engine ``i`` shares the devices of trainer ranks
``[i·tp, (i+1)·tp)`` and its actor sits in the bundle of the first of them. Separate: engines get
a placement group of their own (one bundle of ``tp`` GPUs per engine). On CUDA every GPU of the
node stays visible to the engine and ``--base-gpu-id`` names its first one, so device indices
agree between trainer and engine (CUDA IPC handles of the tensor transport rely on that).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan
from mrl.errors import UnsupportedConfigError
from mrl.net import is_loopback

TOKEN_ENV = "MRL_ENGINE_TOKEN"


@dataclass(frozen=True)
class EngineSlot:
    """One engine: its index, the node it runs on and the node-local GPU ids it uses (empty on CPU)."""

    index: int
    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...]
    bundle: int     # bundle index in the placement group the engine's actor is scheduled into
    url: str
    port: int


def plan_engines(cfg: MRLConfig, infos: list[dict[str, Any]], n_engines: int) -> list[EngineSlot]:
    """Slots for ``n_engines`` engines over ``infos`` (``_RankActor.node_info`` of the devices they
    use: the trainer ranks when colocated, the engines' own bundles when separate)."""
    r, tp = cfg.rollout, cfg.rollout.engine_tp_size
    colocated = r.placement == "colocated"
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


def run_token(cfg: MRLConfig) -> str | None:
    """A fresh per-run control token for every engine, loopback included: any local process (another
    user's, a notebook) could otherwise pause the engines or load weights from disk into them. Both
    engines guard only their control endpoints with it (the embedded engine's token; SGLang's
    ``--admin-api-key``), so /generate and /health stay open and a router needs no key."""
    return secrets.token_urlsafe(32)


def engine_command(cfg: MRLConfig, slot: EngineSlot, token: str | None, *, dtype: str) -> tuple[list[str], dict[str, str]]:
    """(argv, extra env) of ``slot``'s server: ``mrl.rollout.engine.server`` (torch) or SGLang's launch_server,
    in ``dtype``: the run plan's (model.dtype, null resolved for the device), the trainer ranks' dtype."""
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
        # SGLang's --admin-api-key is an argv flag (visible in ps to users of the node); it has no env form.
        return build_sglang_command(SGLangLaunchSpec(
            model_path=cfg.model.path, port=slot.port, host=r.host, tp_size=r.engine_tp_size,
            mem_fraction_static=r.mem_fraction_static, colocated=r.placement == "colocated",
            base_gpu_id=slot.gpu_ids[0], dtype=dtype, random_seed=cfg.trainer.seed + slot.index,
            admin_api_key=token, enable_return_routed_experts=cfg.actor.moe.engine_routed_experts,
            extra_args=[] if r.max_num_seqs is None else
            ["--max-running-requests", str(r.max_num_seqs)])), {}
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


class RemoteEngine:
    """Driver-side handle of one engine server whose process a Ray actor (``EngineLauncher``, an
    ``EngineProcess``) owns on the slot's node. Every call waits with a timeout; ``stop`` ends the server,
    then the actor."""

    def __init__(self, slot: EngineSlot, cmd: list[str], env: dict[str, str], log_path: Path,
                 startup_timeout_s: float, scheduling_strategy: Any, cuda: bool) -> None:
        import ray

        from mrl.rollout.sglang_launcher import make_engine_actor_class

        self.slot, self.url, self.log_path = slot, slot.url, log_path
        self.pid: int | None = None
        self._startup_timeout_s = startup_timeout_s
        from mrl.cluster.worker_group import ALL_GPUS_VISIBLE

        runtime_env = ALL_GPUS_VISIBLE if cuda else None
        self._actor = make_engine_actor_class().options(
            scheduling_strategy=scheduling_strategy, runtime_env=runtime_env,
            max_concurrency=2,  # stop() must get through while a restart waits for health
        ).remote(cmd, slot.url, str(log_path), env=env, startup_timeout_s=startup_timeout_s)
        self._ray = ray

    def _call(self, method: str, timeout_s: float, *args: Any) -> Any:
        return self._ray.get(getattr(self._actor, method).remote(*args), timeout=timeout_s)

    def start(self) -> None:
        self._call("start", 120.0, False)
        self.pid = self._call("get_pid", 30.0)

    def wait_healthy(self) -> float:
        return self._call("wait_healthy", self._startup_timeout_s + 60.0)

    def restart(self) -> None:
        """The pool's restart callback: same node, same command, same url. A failure is one line (the
        launcher's reason and the last line of the engine's log), not Ray's remote traceback: it becomes
        the engine's ``last_error``, which the run's stop message quotes."""
        try:
            self._call("restart", self._startup_timeout_s + 120.0)
            self.pid = self._call("get_pid", 30.0)
        except Exception as e:  # noqa: BLE001 - any failure: the engine stays out, the reason kept short
            raise EngineRestartError(self.slot, self.log_path, e) from None

    def kill(self) -> None:
        self._call("kill", 60.0)

    def log_tail(self, lines: int = 40) -> str:
        return self._call("log_tail", 30.0, lines)

    def stop(self) -> None:
        """Stop the server through its actor; if that fails (a stuck or dead actor) and the server
        runs on this node, kill its process group from here, so no server outlives the run."""
        try:
            self._call("stop", 60.0)
        except Exception:
            if not self._kill_local():
                raise
        finally:
            self._ray.kill(self._actor)

    def _kill_local(self) -> bool:
        """SIGKILL the server's process group if it is on the driver's node and still this server."""
        import os
        import signal

        if self.pid is None or self.slot.node_id != self._ray.get_runtime_context().get_node_id():
            return False
        try:
            with open(f"/proc/{self.pid}/cmdline", "rb") as f:  # the pid may have been reused
                if str(self.slot.port).encode() not in f.read():
                    return True
            os.killpg(self.pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass  # already gone
        return True


def _separate_placement(cfg: MRLConfig, cuda: bool, n: int, timeout_s: float = 600.0
                        ) -> tuple[Any, list[dict[str, Any]]]:
    """A placement group of ``n`` engine bundles (``tp`` GPUs each on CUDA) and where they landed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from mrl.cluster.worker_group import ALL_GPUS_VISIBLE, placement_info

    tp = cfg.rollout.engine_tp_size
    bundle = {"CPU": 1, **({"GPU": tp} if cuda else {})}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise UnsupportedConfigError(f"Ray could not place {n} separate engines with {bundle} each within "
                                     f"{timeout_s:.0f}s; fix: lower rollout.num_engines or add devices") from None

    probe = ray.remote(placement_info)
    refs = [probe.options(num_cpus=0.01, num_gpus=tp if cuda else 0, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=i), runtime_env=ALL_GPUS_VISIBLE if cuda else None).remote()
        for i in range(n)]
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
        # The trainer's source ranks reach an engine on another node only through a routable address.
        self.remote_nodes = len({s.node_id for s in self.slots} | {i["node_id"] for i in workers.infos}) > 1
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
                e = RemoteEngine(slot, cmd, env, plan.log_dir.resolve() / f"engine_{slot.index}.log",
                                 r.engine_startup_timeout_s, strategy, cuda=bool(slot.gpu_ids))
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
