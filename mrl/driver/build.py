"""Build every component of a run, and tear them all down (engines killed, Ray shut down) on exit."""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mrl.config import MRLConfig
from mrl.config.run_plan import RunPlan, gen_batch_size, plan_run, ray_actors
from mrl.driver.ranks import TrainRanks
from mrl.driver.stop import (
    STOP_CLOSE_GRACE_S,
    RunInterrupted,
    RunStop,
    children_of_self,
    stop_line,
)
from mrl.errors import InputRefusedError, UnsupportedConfigError

if TYPE_CHECKING:  # the driver imports these lazily inside build(); the annotations name them
    from transformers import PreTrainedTokenizerBase

    from mrl.agent.loop import AgentClient
    from mrl.cluster import WorkerGroup
    from mrl.data.dataset import PromptDataset
    from mrl.driver.engines import EngineSet
    from mrl.driver.judge import Judge
    from mrl.driver.rm_reward import RewardModelInputs
    from mrl.driver.vision import Pictures
    from mrl.observability.tracking import Tracking
    from mrl.rewards import RewardManager
    from mrl.rollout import EnginePool, RolloutClient

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


@dataclass(frozen=True)
class RunInputs:
    """Stage 1 of ``build``, before Ray starts: what the run reads, every row checked. Nothing here is
    running, so nothing needs stopping but the reward functions' pool (``reward.close``)."""

    tokenizer: PreTrainedTokenizerBase
    pad_token_id: int
    train_ds: PromptDataset
    val_ds: PromptDataset | None  # data.val_files unset: no validation
    reward: RewardManager
    rm_inputs: RewardModelInputs | None  # reward_model.enable: the batch the RM scores (driver/rm_reward.py)
    pictures: Pictures | None  # a vision-language actor: the image processor of the trainer's inputs (driver/vision.py)
    agent_tools: dict | None  # agent.enable: the configured tools by name
    sampler: Any  # data.sampler.class_path over train_ds (mrl.data.sampler): its batches per epoch fix the run length
    resumed_from: Path | None  # the checkpoint a resume loads, verified
    log_dir: Path  # engine / router logs (= RunPlan.log_dir)


@dataclass(frozen=True)
class Services:
    """What ``build`` started, for the step (``RLTrainer``): made once, when every part is running, and
    never changed after. A ``| None`` field is a part the config leaves out, not one filled in later.
    Teardown does not read this object: each part is registered for stopping the moment it starts."""

    tokenizer: PreTrainedTokenizerBase
    pad_token_id: int
    train_ds: PromptDataset
    val_ds: PromptDataset | None  # data.val_files unset
    reward: RewardManager
    rm_inputs: RewardModelInputs | None  # reward_model.enable
    pictures: Pictures | None  # a vision-language actor (driver/vision.py)
    sampler: Any  # the training prompts' order, resumable (mrl.data.sampler)
    log_dir: Path
    plan: RunPlan  # the derived values, with the device Ray shows and the run length
    workers: WorkerGroup  # the trainer ranks
    rm_workers: WorkerGroup | None  # reward_model.placement=separate: the RM's own ranks (driver/side_ranks.py)
    teacher_workers: WorkerGroup | None  # teacher.placement=separate: its own ranks (driver/side_ranks.py)
    ref_workers: WorkerGroup | None  # ref.placement=separate: its own ranks (driver/side_ranks.py)
    engines: EngineSet
    pool: EnginePool  # the engines: health, restarts, control calls, weight sync
    client: RolloutClient | AgentClient  # what generates (through the router, the agent loop when agent.enable)
    judge: Judge | None  # reward.judge.enable: its engines and the reward phase's judge (driver/judge.py)
    tracking: Tracking | None  # None when trainer.logger names no sink
    stop: RunStop | None = None  # SIGTERM / Ctrl-C handling (driver/stop.py); the trainer tells it the step running


@contextlib.contextmanager
def build(cfg: MRLConfig) -> Iterator[Services]:
    """Yield the built ``Services``; everything started is stopped on exit, errors included, in the
    reverse order of starting (engines before the ranks whose placement group holds them, Ray last)."""
    from mrl.driver.judge import start_judge

    check_inputs(cfg)
    stop = RunStop(cfg.trainer.checkpoint_dir)
    stop.install()  # a signal now raises RunInterrupted, and the teardown below runs in stop mode
    try:
        inputs = read_inputs(cfg, gen_batch_size(cfg))
        with contextlib.ExitStack() as stack:
            stack.callback(_quietly, "reward functions", inputs.reward.close)
            device = _start_ray(cfg, stack, stop)
            # the run's one plan: the device Ray shows, the run length from the sampler's batches per epoch
            plan = plan_run(cfg, device, inputs.sampler.batches_per_epoch)
            workers, (rm_workers, teacher_workers, ref_workers), engines = _start_ranks_and_engines(cfg, plan, stack, stop)
            judge = _start(stack, "judge", start_judge(cfg, plan, workers, engines, inputs.tokenizer), stop)  # reward.judge
            pool, client = _start_rollout(cfg, plan, engines, inputs, stack)
            TrainRanks(workers).init_weight_sync(engines.urls, token=engines.token, routable=engines.remote_nodes)
            tracking = _start_tracking(cfg, inputs, stack)
            stack.callback(_stop_mode, stop)  # runs first on the way out
            yield Services(inputs.tokenizer, inputs.pad_token_id, inputs.train_ds, inputs.val_ds, inputs.reward,
                           inputs.rm_inputs, inputs.pictures, inputs.sampler, inputs.log_dir, plan, workers, rm_workers, teacher_workers, ref_workers,
                           engines, pool, client, judge, tracking, stop)
    except KeyboardInterrupt:  # RunInterrupted, or what Ray's blocking calls made of it
        if stop.signum is None:
            raise
        stopped = RunInterrupted(stop.signum, stop_line(stop.signum, stop.step, stop.root))  # the line mrl train prints
        stopped.exit_now = stop.ray_killed  # Ray's processes are gone: no atexit shutdown
        raise stopped from None
    finally:
        stop.restore()


def _stop_mode(stop: RunStop) -> None:
    """The first step of the teardown: from here a signal no longer raises (the teardown it would cut short is
    the stop itself); after a stop, a Ray instance of the run's own is killed (mrl/driver/stop.py)."""
    stop.raising = False
    stop.kill_own_ray()


def _ray_step(stop: RunStop, what: str, fn, *args, **kwargs) -> None:
    """A teardown step made of Ray calls: skipped when the stop killed the run's own Ray instance (a Ray call
    would wait 60 s for its GCS); after a stop, a group's close gets STOP_CLOSE_GRACE_S, not 30 s."""
    stop.kill_own_ray()  # a signal that came during build: _stop_mode has not run
    if stop.ray_killed:
        return
    if not stop.requested:
        _quietly(what, fn, *args, **kwargs)
        return
    if "timeout_s" in kwargs:
        kwargs["timeout_s"] = min(kwargs["timeout_s"], STOP_CLOSE_GRACE_S)
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - expected when stopping: a rank busy in the abandoned phase is killed
        log.info("stopping: %s: %s", what, e)


def read_inputs(cfg: MRLConfig, gen_batch: int) -> RunInputs:
    """Stage 1: tokenizer, datasets (every row checked here, before Ray starts: DataError names
    file:row:column and ``mrl train`` exits 2), the reward functions, the resume checkpoint and the disk room.
    ``gen_batch``: prompts per generation round (run_plan.gen_batch_size, the plan's value; DAPO: data.gen_batch_size)."""
    from transformers import AutoTokenizer

    from mrl.data.dataset import PromptDataset, check_batch_fits
    from mrl.data.sampler import sampler_for
    from mrl.data.tokenize import pad_token_id_of
    from mrl.driver.disk_full import check_room
    from mrl.driver.rm_reward import RewardModelInputs
    from mrl.driver.vision import Pictures, vision_spec
    from mrl.rewards import RewardManager

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    # the built-in scorers compare the ground truth as text, so it must be a string or number
    scalar_gt = ":" not in cfg.reward.function
    agent_tools, schemas = _agent_tools(cfg, tok)
    d = cfg.data
    vision = vision_spec(cfg.model.path)  # a vision-language actor: rows may carry pictures
    train_ds = PromptDataset.from_config(d, tok, "train", scalar_ground_truth=scalar_gt, tools=schemas, vision=vision)
    check_batch_fits(len(train_ds), gen_batch, d.train_files, train_ds.num_filtered)
    val_ds = (PromptDataset.from_config(d, tok, "val", scalar_ground_truth=scalar_gt, tools=schemas, vision=vision)
              if d.val_files else None)
    sampler = sampler_for(d, gen_batch, train_ds)
    resumed_from = _check_resume_dir(cfg)
    check_room(cfg.trainer.checkpoint_dir, cfg.trainer.save_freq, resumed_from)  # a full disk: before Ray, not at a save
    return RunInputs(tok, pad_token_id_of(tok), train_ds, val_ds, RewardManager.from_config(cfg.reward),
                     RewardModelInputs.from_config(cfg, tok) if cfg.reward_model.enable else None,
                     Pictures(cfg.model.path, vision) if vision else None, agent_tools,
                     sampler, resumed_from, Path(cfg.trainer.checkpoint_dir or "outputs") / "logs")


def _start_ray(cfg: MRLConfig, stack: contextlib.ExitStack, stop: RunStop) -> str:
    """Stage 2: Ray (a CPU per rank of every group and per separate engine); returns the device it shows
    (``cluster.device``, ``auto`` resolved)."""
    import ray

    from mrl.cluster import init_ray

    ranks, separate_engines = ray_actors(cfg)
    before = children_of_self()
    stack.callback(_ray_step, stop, "Ray", ray.shutdown)
    init_ray(cfg.cluster.address, cfg.cluster.cpus_per_node or max(os.cpu_count() or 1, ranks) + separate_engines)
    if not cfg.cluster.address:  # an instance of the run's own: its processes are the driver's new children
        stop.own_ray(sorted(children_of_self() - before))
    stop.install()  # again: ray.init installed its own SIGTERM handler (sys.exit)
    device = resolve_device(cfg.cluster.device)
    if device == "cpu":
        # The ranks (and their engines) use this host's cores; the driver's tensors are small
        # ([batch, response] advantages and masks). With torch's default of one thread per core, the
        # OpenMP worker of the driver's few parallel ops spun on a core the ranks need (docs/performance.md,
        # 'One torch thread in the CPU driver').
        import torch

        torch.set_num_threads(1)
    return device


def _start_ranks_and_engines(cfg: MRLConfig, plan: RunPlan, stack: contextlib.ExitStack, stop: RunStop):
    """Stage 3: the trainer ranks, a separate RM's, teacher's and reference's ranks, and the engines, which start on the
    ranks' nodes (colocated: in their ranks' placement bundles) and load while the ranks build their models."""
    from mrl.cluster import WorkerGroup
    from mrl.driver.engines import EngineSet
    from mrl.driver.side_ranks import start_side_group

    workers = WorkerGroup("mrl.workers.rank.TrainRank", {"cfg": cfg, "plan": plan}, world_size=plan.trainer_ranks,
                          device=plan.device, extra_env={"OMP_NUM_THREADS": "1"}, wait=False)
    # after the ranks' close (or in its place, when a stop killed them), with no Ray call: a rank killed before its
    # close (a fault; a SIGTERM to the process group reaches the ranks too) leaves its weight sender's segment
    stop.senders = _pids_here(workers)
    stack.callback(_quietly, "weight-sync segments", _remove_segments, stop.senders)
    stack.callback(_ray_step, stop, "trainer ranks", workers.close, "close", timeout_s=30.0)
    groups = []
    sides = (("reward_model", "reward model ranks"), ("teacher", "teacher ranks"), ("ref", "reference ranks"))
    for role, what in sides:
        group = start_side_group(cfg, plan, role)  # None unless that role is separate: its own ranks, world, layout
        if group is not None:
            stack.callback(_ray_step, stop, what, group.close, "close", timeout_s=30.0)
        groups.append(group)
    engines = EngineSet(cfg, plan, workers)
    # registered after the ranks, so stopped before them: colocated engine actors live in the ranks'
    # placement group, which the ranks' teardown removes, and the servers run in sessions of their own
    stack.callback(_ray_step, stop, "engines", lambda: [log.warning("could not stop %s", err) for err in engines.stop()])
    workers.wait_constructed()
    for (role, what), group in zip(sides, groups):
        if group is not None:
            group.wait_constructed()
            par = plan.layout[role].parallel
            log.info("%s: %d of their own, built (TP=%d PP=%d CP=%d)", what, group.world_size,
                     par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.context_parallel_size)
    engines.wait_healthy()
    return workers, tuple(groups), engines


def _start_rollout(cfg: MRLConfig, plan: RunPlan, engines: EngineSet, inputs: RunInputs,
                   stack: contextlib.ExitStack) -> tuple[EnginePool, RolloutClient | AgentClient]:
    """Stage 4: the engine pool (health checks, restarts), the router and the client the step generates with."""
    from mrl.rollout import (
        EngineEndpoint,
        EnginePool,
        RolloutClient,
        disk_resync,
        make_router,
    )

    r = cfg.rollout
    # A dead engine is restarted by the pool; it is brought back to the current weights from disk when a
    # snapshot exists (rollout.weight_sync.snapshot_dir, or the disk transport's dir), else it stays out of
    # service with the reason logged.
    token = engines.token
    pool = _start(stack, "engine pool", EnginePool([EngineEndpoint(e.url, restart=e.restart) for e in engines.engines],
                                                   health_interval_s=r.health_interval_s, token=token))
    snap = r.weight_sync.snapshot_dir or (r.weight_sync.disk_dir if plan.transport == "disk" else None)
    if snap:
        pool.resync = disk_resync(snap, token=token)
    pool.start_health_checks()  # every rollout.health_interval_s: dead engines restart between steps too
    gen_pool = pool
    if r.router == "sglang_router":
        from mrl.rollout.sglang_router import SGLangRouter

        router = SGLangRouter(engines.urls, r.router_port or r.port_base - 1, inputs.log_dir / "sglang_router.log",
                              startup_timeout_s=min(r.engine_startup_timeout_s, 300.0))
        stack.callback(_quietly, "sglang router", router.stop)
        router.start()
        pool.on_service_change = router.on_engine_service  # restarted engines rejoin once synced
        # No periodic probes of the router: it would forward them to engines that may be asleep;
        # a connection error on /generate finds a dead router (no /health) and restarts it.
        gen_pool = _start(stack, "router pool", EnginePool([EngineEndpoint(router.url, restart=router.restart)],
                                                           health_interval_s=0, token=token))
    # sglang-router's /generate takes one sampling_params map: seeded samples then go one per request.
    client: RolloutClient | AgentClient = RolloutClient(
        make_router(gen_pool, r.router, max_retries=r.max_retries, request_timeout_s=r.request_timeout_s),
        params_list_in_batch=r.router != "sglang_router", prompts_per_request=1 if r.router == "sglang_router" else None,
        **_routed_experts_args(cfg))
    if inputs.agent_tools is not None:  # multi-turn, tool-calling rollouts everywhere the client is used
        from mrl.agent.loop import AgentClient

        client = _start(stack, "agent tool workers", AgentClient(client, inputs.tokenizer, inputs.agent_tools, cfg.agent))
    return pool, client


def _start_tracking(cfg: MRLConfig, inputs: RunInputs, stack: contextlib.ExitStack) -> Tracking | None:
    """Stage 5: MLflow and the metric line (verl's -> <run dir>/metrics.log; the console shows progress);
    finished as FINISHED when the run's body returns, FAILED when it raises."""
    from mrl.driver.state import read_trainer_state
    from mrl.observability.tracking import Tracking

    run_id = read_trainer_state(inputs.resumed_from).get("mlflow_run_id") if inputs.resumed_from else None
    tracking = Tracking.from_config(cfg, resume_run_id=run_id, metrics_path=inputs.log_dir.parent / "metrics.log")
    if tracking is not None:
        stack.push(lambda exc_type, *_: _quietly("tracking", tracking.finish, _run_status(exc_type)))
    return tracking


def _run_status(exc_type: type | None) -> str:
    """The MLflow run's end: FINISHED, KILLED (a signal stopped it) or FAILED."""
    if exc_type is None:
        return "FINISHED"
    return "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"  # RunInterrupted, or Ray's copy of it


def _start(stack: contextlib.ExitStack, what: str, part, stop: RunStop | None = None):
    """``part`` (a started component with ``close()``), registered to be closed on exit; None passes through.
    ``stop``: the part's close makes Ray calls (see _ray_step)."""
    if part is not None:
        if stop is None:
            stack.callback(_quietly, what, part.close)
        else:
            stack.callback(_ray_step, stop, what, part.close)
    return part


def _quietly(what: str, fn, *args, **kwargs) -> None:
    """One teardown step; a failure is logged and the rest still run."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - keep tearing down the rest
        log.warning("shutdown of %s failed: %s", what, e)


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


def _pids_here(workers: WorkerGroup) -> list[int]:
    """The process ids of the ranks on the driver's node."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    return [i["pid"] for i in workers.infos if i.get("node_id") == here and "pid" in i]


def _remove_segments(pids: list[int]) -> None:
    """Unlink the weight senders' /dev/shm segments that ranks ``pids`` left (killed before their close: their own
    cleanup races the teardown)."""
    from mrl.rollout.weight_sync.transports import TensorTransport

    for name in TensorTransport.remove_segments(pids):
        log.info("removed /dev/shm/%s, left by a trainer rank that did not close", name)


def _routed_experts_args(cfg: MRLConfig) -> dict:
    """RolloutClient arguments for MoE routing replay: every sample brings the engine's expert ids."""
    if not cfg.actor.moe.engine_routed_experts:
        return {}
    from mrl.rollout.types import RoutedExpertsLayout

    return {"return_routed_experts": True, "routed_experts_layout": RoutedExpertsLayout.from_hf_config(cfg.model.path)}
