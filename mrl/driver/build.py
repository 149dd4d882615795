"""Build every component of a run, and tear them all down (engines killed, Ray shut down) on exit."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan, plan_run
from mrl.driver.ranks import TrainRanks
from mrl.errors import InputRefusedError, UnsupportedConfigError

if TYPE_CHECKING:  # the driver imports these lazily inside build(); the annotations name them
    from transformers import PreTrainedTokenizerBase

    from mrl.cluster import WorkerGroup
    from mrl.data.dataset import PromptDataset
    from mrl.driver.engines import EngineSet
    from mrl.driver.judge import Judge
    from mrl.driver.rm_reward import RewardModelInputs
    from mrl.observability.tracking import Tracking
    from mrl.rewards import RewardManager
    from mrl.rollout import EnginePool, RolloutClient
    from mrl.rollout.sglang_router import SGLangRouter

log = logging.getLogger(__name__)


def check_inputs(cfg: MRLConfig) -> None:
    """``mrl train``'s one check beyond config validation (done when the config loaded): the files
    the run reads exist here. ``mrl plan`` shows the same list as notes."""
    from mrl.config.validate import missing_inputs

    missing = missing_inputs(cfg)
    if missing:
        raise UnsupportedConfigError("\n  ".join(missing))


def _check_resume_dir(cfg: MRLConfig) -> Path | None:
    """The checkpoint a resume will load, checked in the driver before Ray starts: it exists, its
    shard files are all there, and its tensor index is torch DCP metadata (never unpickled as
    arbitrary objects: mrl.megatron.safe_metadata) — rather than failing (or worse) in every rank."""
    from mrl.driver.base_model import mismatch
    from mrl.driver.state import find_resume_dir, read_trainer_state
    from mrl.megatron.checkpoint import CheckpointError, verify_checkpoint

    try:
        d = find_resume_dir(cfg.trainer.checkpoint_dir, cfg.trainer.resume_mode)
        if d is not None:
            for role in ("actor", *(("critic",) if cfg.critic_enabled and (d / "critic").is_dir() else ())):
                verify_checkpoint(d / role)
            why = mismatch(cfg.model.path, verify_checkpoint(d / "actor", checksums=False)["metadata"].get("hf_config"),
                           read_trainer_state(d).get("base_model"))
            if why:
                raise CheckpointError(f"{d} was not trained from model.path={cfg.model.path!r}: {why}; fix: point model.path "
                                      "at the run's base model, or start a new run (trainer.resume_mode=disable or "
                                      "another trainer.default_local_dir)")
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        # not a checkpoint, a corrupt one or another model's: a user mistake, exit 2 like a config error
        # (a resume_mode path that does not exist at all is one already)
        raise InputRefusedError(f"trainer.resume_mode={cfg.trainer.resume_mode!r}: {e}") from None
    return d


def resolve_device(device: str) -> str:
    """``cluster.device``, with ``auto`` -> ``cuda`` when the Ray cluster has GPUs (the driver's own
    node may have none), else ``cpu``. Resolved once, into the run plan (the config is not written)."""
    import ray

    if device != "auto":
        return device
    resolved = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
    log.info("cluster.device=auto resolved to %s", resolved)
    return resolved


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


def _trap_sigterm() -> None:
    """Engines run in their own sessions: SIGTERM must unwind through build()'s cleanup (engines
    stopped, Ray shut down) instead of killing the driver and leaving the servers behind."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


@dataclass
class Services:
    """What ``build`` started, for the step (``RLTrainer``) and for teardown."""

    tokenizer: PreTrainedTokenizerBase
    pad_token_id: int
    train_ds: PromptDataset
    val_ds: PromptDataset | None
    reward: RewardManager
    tracking: Tracking | None
    log_dir: Path
    engines: EngineSet | None = None
    pool: EnginePool | None = None  # the engines: health, restarts, control calls, weight sync
    router: SGLangRouter | None = None  # sglang_router process (rollout.router=sglang_router)
    route_pool: EnginePool | None = None  # what /generate goes to when the router is sglang_router: the router alone
    client: RolloutClient | None = None
    workers: WorkerGroup | None = None
    rm_workers: WorkerGroup | None = None  # reward_model.placement=separate: the RM's own ranks (driver/rm_ranks.py)
    teacher_workers: WorkerGroup | None = None  # teacher.placement=separate: its own ranks (driver/teacher_ranks.py)
    plan: RunPlan | None = None  # set once Ray shows its devices
    rm_inputs: RewardModelInputs | None = None  # reward_model.enable: the batch the RM scores (driver/rm_reward.py)
    judge: Judge | None = None  # reward.judge.enable: its engines and the reward phase's judge (driver/judge.py)


@contextlib.contextmanager
def build(cfg: MRLConfig) -> Iterator[Services]:
    """Yield the built ``Services``; everything started is stopped on exit, errors included."""
    from transformers import AutoTokenizer

    from mrl.cluster import WorkerGroup, init_ray
    from mrl.data.dataset import PromptDataset, check_batch_fits
    from mrl.data.tokenize import pad_token_id_of
    from mrl.driver.engines import EngineSet
    from mrl.driver.judge import start_judge
    from mrl.driver.rm_ranks import start_reward_model_group
    from mrl.driver.rm_reward import RewardModelInputs
    from mrl.driver.state import read_trainer_state
    from mrl.driver.teacher_ranks import start_teacher_group
    from mrl.observability.tracking import Tracking
    from mrl.rewards import RewardManager
    from mrl.rollout import (
        EngineEndpoint,
        EnginePool,
        RolloutClient,
        disk_resync,
        make_router,
    )

    check_inputs(cfg)
    _trap_sigterm()
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    log_dir = Path(cfg.trainer.checkpoint_dir or "outputs") / "logs"  # = RunPlan.log_dir
    # Every row is checked here, before Ray starts (DataError: file:row:column, `mrl train` exits 2);
    # the built-in scorers compare the ground truth as text, so it must be a string or number.
    scalar_gt = ":" not in cfg.reward.function
    agent_tools, schemas = _agent_tools(cfg, tok)
    train_ds = PromptDataset.from_config(cfg.data, tok, "train", scalar_ground_truth=scalar_gt, tools=schemas)
    d = cfg.data
    check_batch_fits(len(train_ds), (d.gen_batch_size or d.train_batch_size) if cfg.algorithm.filter_groups.enable
                     else d.train_batch_size, d.train_files, train_ds.num_filtered)
    resumed_from = _check_resume_dir(cfg)
    from mrl.driver.disk_full import check_room

    check_room(cfg.trainer.checkpoint_dir, cfg.trainer.save_freq, resumed_from)  # a full disk: before Ray, not at a save
    s = Services(tok, pad_token_id_of(tok), train_ds,
                 PromptDataset.from_config(d, tok, "val", scalar_ground_truth=scalar_gt, tools=schemas) if d.val_files else None,
                 RewardManager.from_config(cfg.reward), None, log_dir)
    if cfg.reward_model.enable:
        s.rm_inputs = RewardModelInputs.from_config(cfg, tok)
    status = "FAILED"
    try:
        r = cfg.rollout
        cpu_plan = plan_run(cfg, "cpu")  # the layout does not depend on the device
        world = cpu_plan.trainer_ranks + cpu_plan.reward_model_ranks + cpu_plan.teacher_ranks  # a CPU per rank
        extra_cpus = r.num_engines if r.placement == "separate" and r.num_engines else 0
        init_ray(cfg.cluster.address, cfg.cluster.cpus_per_node or max(os.cpu_count() or 1, world) + extra_cpus)
        _trap_sigterm()  # again: ray.init installed its own handler, which aborts
        s.plan = plan = plan_run(cfg, resolve_device(cfg.cluster.device))
        if plan.device == "cpu":
            # The ranks (and their engines) use this host's cores; the driver's tensors are small
            # ([batch, response] advantages and masks). With torch's default of one thread per core, the
            # OpenMP worker of the driver's few parallel ops spun ~4 ms of a core per tiny benchmark step.
            import torch

            torch.set_num_threads(1)
        s.workers = WorkerGroup("mrl.workers.rank.TrainRank", {"cfg": cfg, "plan": plan},
                                world_size=plan.trainer_ranks, device=plan.device,
                                extra_env={"OMP_NUM_THREADS": "1"}, wait=False)
        s.rm_workers = start_reward_model_group(cfg, plan)  # a separate RM: its own ranks, world and layout
        s.teacher_workers = start_teacher_group(cfg, plan)  # a separate teacher: likewise
        # Engines start on the ranks' nodes (colocated: in their ranks' placement bundles) and load
        # while the ranks build their models.
        s.engines = EngineSet(cfg, plan, s.workers)
        s.workers.wait_constructed()
        for group in (s.rm_workers, s.teacher_workers):
            if group is not None:
                group.wait_constructed()
        s.engines.wait_healthy()
        s.judge = start_judge(cfg, plan, s.workers, s.engines, tok)  # reward.judge: its engines (docs/judge.md)
        # A dead engine is restarted by the pool; it is brought back to the current weights from
        # disk when a snapshot exists (rollout.weight_sync.snapshot_dir, or the disk transport's dir),
        # else it stays out of service with the reason logged.
        token = s.engines.token
        s.pool = EnginePool([EngineEndpoint(e.url, restart=e.restart) for e in s.engines.engines],
                            health_interval_s=r.health_interval_s, token=token)
        snap = r.weight_sync.snapshot_dir or (r.weight_sync.disk_dir if s.plan.transport == "disk" else None)
        if snap:
            s.pool.resync = disk_resync(snap, token=token)
        s.pool.start_health_checks()  # every rollout.health_interval_s: dead engines restart between steps too
        gen_pool = s.pool
        if r.router == "sglang_router":
            from mrl.rollout.sglang_router import SGLangRouter

            s.router = SGLangRouter(s.engines.urls, r.router_port or r.port_base - 1, log_dir / "sglang_router.log",
                                    startup_timeout_s=min(r.engine_startup_timeout_s, 300.0))
            s.router.start()
            s.pool.on_service_change = s.router.on_engine_service  # restarted engines rejoin once synced
            # No periodic probes of the router: it would forward them to engines that may be asleep;
            # a connection error on /generate finds a dead router (no /health) and restarts it.
            gen_pool = s.route_pool = EnginePool([EngineEndpoint(s.router.url, restart=s.router.restart)],
                                                 health_interval_s=0, token=token)
        # sglang-router's /generate takes one sampling_params map: seeded samples then go one per request.
        s.client = RolloutClient(make_router(gen_pool, r.router, max_retries=r.max_retries,
                                             request_timeout_s=r.request_timeout_s),
                                 params_list_in_batch=r.router != "sglang_router",
                                 prompts_per_request=1 if r.router == "sglang_router" else None,
                                 **_routed_experts_args(cfg))
        if agent_tools is not None:  # multi-turn, tool-calling rollouts everywhere the client is used
            from mrl.agent.loop import AgentClient

            s.client = AgentClient(s.client, tok, agent_tools, cfg.agent)
        TrainRanks(s.workers).init_weight_sync(s.engines.urls, token=token, routable=s.engines.remote_nodes)
        s.tracking = Tracking.from_config(  # verl's metric line -> <run dir>/metrics.log; the console shows progress
            cfg, resume_run_id=read_trainer_state(resumed_from).get("mlflow_run_id") if resumed_from else None,
            metrics_path=s.log_dir.parent / "metrics.log")  # log_dir = <checkpoint_dir or outputs>/logs
        yield s
        status = "FINISHED"
    finally:
        _teardown(s, status)


def _agent_tools(cfg: MRLConfig, tok) -> tuple[dict | None, list[dict] | None]:
    """agent.enable: the configured tools and their schemas, after checking that model.path's chat
    template renders them and tool messages (docs/agent.md); (None, None) otherwise."""
    if not cfg.agent.enable:
        return None, None
    from mrl.agent.template import TemplateError, check_tools_template
    from mrl.agent.tools import load_tools

    tools = load_tools(cfg.agent.tools)
    schemas = [t.schema for t in tools.values()]
    try:
        check_tools_template(tok, schemas)
    except TemplateError as e:
        raise UnsupportedConfigError(f"agent.enable with model.path={cfg.model.path}: {e}") from None
    return tools, schemas


def _teardown(s: Services, status: str) -> None:
    import ray

    # Engines before the ranks and Ray: colocated engine actors live in the ranks' placement group,
    # which the rank teardown removes (killing them), and the servers run in sessions of their own.
    for step in (
        lambda: s.tracking and s.tracking.finish(status),
        lambda: getattr(s.client, "runner", None) and s.client.close(),  # the agent loop's tool workers
        lambda: s.judge and s.judge.close(),
        lambda: s.route_pool and s.route_pool.close(),
        lambda: s.router and s.router.stop(),
        lambda: s.pool and s.pool.close(),
        lambda: [log.warning("could not stop %s", err) for err in (s.engines.stop() if s.engines else [])],
        lambda: s.workers and _close_ranks(s.workers),
        lambda: s.rm_workers and s.rm_workers.close("close", timeout_s=30.0),
        lambda: s.teacher_workers and s.teacher_workers.close("close", timeout_s=30.0),
        lambda: s.reward.close(),
        ray.shutdown,
    ):
        try:
            step()
        except Exception as e:  # noqa: BLE001 - keep tearing down the rest
            log.warning("shutdown step failed: %s", e)


def _close_ranks(workers: WorkerGroup) -> None:
    """Close the trainer ranks (30 s), then unlink the weight senders' /dev/shm segments that a rank killed
    before its close left on this node (a SIGKILLed rank's own cleanup races the teardown)."""
    import ray

    from mrl.rollout.weight_sync.transports import TensorTransport

    here = ray.get_runtime_context().get_node_id()
    pids = [i["pid"] for i in workers.infos if i.get("node_id") == here and "pid" in i]
    try:
        workers.close("close", timeout_s=30.0)
    finally:
        for name in TensorTransport.remove_segments(pids):
            log.info("removed /dev/shm/%s, left by a trainer rank that did not close", name)


def _routed_experts_args(cfg: MRLConfig) -> dict:
    """RolloutClient arguments for MoE routing replay: every sample brings the engine's expert ids."""
    if not cfg.actor.moe.engine_routed_experts:
        return {}
    from mrl.rollout.types import RoutedExpertsLayout

    return {"return_routed_experts": True, "routed_experts_layout": RoutedExpertsLayout.from_hf_config(cfg.model.path)}
