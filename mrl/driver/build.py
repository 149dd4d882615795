"""Build every component of a run, and tear them all down (engines killed, Ray shut down) on exit."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrl.config import MRLConfig
from mrl.train import UnsupportedConfigError

log = logging.getLogger(__name__)


def check_supported(cfg: MRLConfig) -> None:
    """Refuse what this driver does not run yet, naming the key (rather than training wrongly)."""
    problems = []
    if cfg.critic_enabled:
        problems += _critic_problems(cfg)
    if cfg.rollout.engine != "torch":
        problems.append("rollout.engine=sglang: set rollout.engine=torch")
    if cfg.rollout.placement != "colocated":
        problems.append("rollout.placement=separate: set rollout.placement=colocated")
    if problems:
        raise UnsupportedConfigError("the RL driver does not support yet:\n  - " + "\n  - ".join(problems))
    critic_path = [("critic.model_path", cfg.critic.model_path)] if cfg.critic_enabled and cfg.critic.model_path else []
    for key, path in (("model.path", cfg.model.path), *critic_path,
                      *(("data.train_files", f) for f in cfg.data.train_files)):
        if not Path(path).exists():
            raise UnsupportedConfigError(f"{key}={path!r} does not exist; for the quickstart run "
                                    "`python -m mrl.quickstart --out outputs/quickstart` first (make train does)")


_GROUP_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
               "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size")


def _critic_problems(cfg: MRLConfig) -> list[str]:
    """The critic is colocated on the actor's ranks and reuses its Megatron groups (there is one
    ``parallel_state`` per process), so its group-defining sizes must equal the actor's."""
    c, out = cfg.critic, []
    if c.placement != "colocated":
        out.append("critic.placement=separate: set critic.placement=colocated (critic.num_devices unset)")
    diff = [k for k in _GROUP_KEYS if getattr(c.megatron, k) != getattr(cfg.actor.megatron, k)]
    if diff:
        out.append("critic.megatron layout differs from actor.megatron in " + ", ".join(
            f"critic.megatron.{k}={getattr(c.megatron, k)} (actor {getattr(cfg.actor.megatron, k)})" for k in diff)
            + ": the colocated critic shares the actor's parallel groups; set critic.megatron.<key> equal to actor.megatron.<key>")
    return out


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


def _trap_sigterm() -> None:
    """Engines run in their own sessions: SIGTERM must unwind through build()'s cleanup (engines
    stopped, Ray shut down) instead of killing the driver and leaving the servers behind."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


@dataclass
class Services:
    tokenizer: Any
    pad_token_id: int
    train_ds: Any
    val_ds: Any
    reward: Any
    tracking: Any
    log_dir: Path
    engines: list = field(default_factory=list)
    pool: Any = None
    client: Any = None
    workers: Any = None


def _n_engines(cfg: MRLConfig) -> int:
    return cfg.rollout.num_engines or max(1, cfg.cluster.world_size // cfg.rollout.engine_tp_size)


@contextlib.contextmanager
def build(cfg: MRLConfig, total_optimizer_steps: int | None) -> Iterator[Services]:
    """Yield the built ``Services``; everything started is stopped on exit, errors included."""
    from transformers import AutoTokenizer

    from mrl.cluster import WorkerGroup, init_ray
    from mrl.data.dataset import PromptDataset
    from mrl.data.tokenize import pad_token_id_of
    from mrl.observability.tracking import Tracking
    from mrl.rewards import RewardManager
    from mrl.rollout import (
        EngineEndpoint,
        EnginePool,
        EngineProcess,
        RolloutClient,
        build_embedded_command,
        disk_resync,
        make_router,
    )

    check_supported(cfg)
    _trap_sigterm()
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    log_dir = Path(cfg.trainer.checkpoint_dir or "outputs") / "logs"
    s = Services(tok, pad_token_id_of(tok), PromptDataset.from_config(cfg.data, tok, "train"),
                 PromptDataset.from_config(cfg.data, tok, "val") if cfg.data.val_files else None,
                 RewardManager.from_config(cfg.reward), None, log_dir)
    status = "FAILED"
    try:
        # Engines first: they are separate processes and load while Ray and the ranks start.
        r = cfg.rollout
        for i in range(_n_engines(cfg)):
            url = f"http://{r.host}:{r.port_base + i}"
            e = EngineProcess(build_embedded_command(cfg.model.path, r.port_base + i, host=r.host), url,
                              log_dir / f"engine_{i}.log", env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                              startup_timeout_s=r.engine_startup_timeout_s)
            e.start(wait=False)
            s.engines.append(e)
        world = cfg.cluster.world_size
        init_ray(cfg.cluster.address, cfg.cluster.cpus_per_node or max(os.cpu_count() or 1, world))
        _trap_sigterm()  # again: ray.init installed its own handler, which aborts
        device = cfg.cluster.device if cfg.cluster.device != "auto" else "cpu"
        s.workers = WorkerGroup("mrl.driver.rank.TrainRank", {"cfg": cfg, "total_optimizer_steps": total_optimizer_steps},
                                world_size=world, device=device,
                                extra_env={"OMP_NUM_THREADS": "1"})
        for e in s.engines:
            e.wait_healthy()
        # A dead engine is restarted by the pool; it is brought back to the current weights from
        # disk when a snapshot exists (rollout.weight_sync.snapshot_dir, or the disk transport's dir),
        # else it stays out of service with the reason logged.
        s.pool = EnginePool([EngineEndpoint(e.url, restart=e.restart) for e in s.engines],
                            health_interval_s=r.health_interval_s)
        snap = r.weight_sync.snapshot_dir or (r.weight_sync.disk_dir if r.weight_sync.transport == "disk" else None)
        if snap:
            s.pool.resync = disk_resync(snap)
        s.client = RolloutClient(make_router(s.pool, r.router, max_retries=r.max_retries,
                                             request_timeout_s=r.request_timeout_s))
        s.workers.execute_all("init_weight_sync", [e.url for e in s.engines])
        s.tracking = Tracking.from_config(cfg)
        yield s
        status = "FINISHED"
    finally:
        _teardown(s, status)


def _teardown(s: Services, status: str) -> None:
    import ray

    for step in (
        lambda: s.tracking and s.tracking.finish(status),
        lambda: s.workers and s.workers.close("close", timeout_s=30.0),
        lambda: s.pool and s.pool.close(),
        lambda: s.reward.close(),
        ray.shutdown,
    ):
        try:
            step()
        except Exception as e:  # noqa: BLE001 - keep tearing down the rest
            log.warning("shutdown step failed: %s", e)
    for e in s.engines:
        try:
            e.stop()
        except Exception as ex:  # noqa: BLE001
            log.warning("could not stop engine %s: %s", e.url, ex)
