"""The frozen run plan: every value derived from the config, computed once.

The config says what the user asked for; the plan says what the run does with it. The driver makes
the plan once (``mrl.driver.build``), when Ray shows its devices (``cluster.device=auto`` resolved
there) and the training set's batches per epoch are known, and hands it to the components that need a
derived value — the trainer ranks, the engines, the step — so no two places compute the LR-schedule
length, the dtype or the device, and nothing writes back into the config. Two values are needed before
the plan can exist, and come from the functions the plan itself uses: the prompts per generation round
(:func:`gen_batch_size`, to batch the data before Ray starts) and the Ray actors to make room for
(:func:`ray_actors`, to start Ray). ``mrl plan`` prints a plan made by the same function
(:mod:`mrl.config.plan_report`).

    mini-batches / step      = data.train_batch_size // <role>.ppo_mini_batch_size
    optimizer steps / step   = mini-batches * <role>.ppo_epochs
    run length (steps)       = trainer.total_training_steps, else trainer.total_epochs * the sampler's batches
                               per epoch (verl: len(train_dataloader) * total_epochs), known once the data is
                               loaded (``mrl train``; ``mrl plan`` prints it from the counted rows)
    LR-schedule length       = (<role>.optim.total_training_steps or run length) * optimizer steps / step
    samples / step           = data.train_batch_size * rollout.n
    samples / mini-batch     = <role>.ppo_mini_batch_size * rollout.n
    engines                  = rollout.num_engines, or (colocated, null) actor devices // rollout.engine_tp_size

Settings left at ``auto`` (rollout.weight_sync.transport, actor.shared_prefix, <role>.megatron.attention_backend,
actor.use_remove_padding) are resolved here for the
device (mrl/config/auto.py): components read the plan's value, never the config's ``auto``.

The critic's ``ppo_mini_batch_size`` / ``ppo_epochs`` fall back to the actor's when unset (verl).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mrl.config.auto import AutoChoice, backend_of, resolve_all, resolve_transport
from mrl.config.layout import RoleLayout, compute_layout
from mrl.config.root import MRLConfig


@dataclass(frozen=True)
class UpdatePlan:
    """How one trained role (actor or critic) steps its optimizer in one RL step."""

    mini_batch_size_samples: int  # samples per mini-batch (prompts x rollout.n)
    mini_batches_per_step: int
    epochs: int
    total_optimizer_steps: int | None  # LR-schedule length; None = constant schedule


@dataclass(frozen=True)
class StepPhases:
    """Which optional phases ``RLTrainer.step`` runs (mrl/driver/trainer.py), decided once from the config."""

    agent: bool = False  # agent.enable: multi-turn rollouts, agent metrics
    filter_groups: bool = False  # algorithm.filter_groups.enable: DAPO dynamic sampling
    dump_rollout: bool = False  # trainer.rollout_data_dir set
    remax_baseline: bool = False  # adv_estimator=remax: a greedy rollout per prompt
    ref: bool = False  # a reference model is built (cfg.ref_enabled)
    teacher: bool = False  # teacher.enable: phase teacher_log_prob
    values: bool = False  # a critic is built (cfg.critic_enabled): values, update_critic
    distill_reward: bool = False  # algorithm.distill.mode != none: the task reward weighed (+ the reverse-KL reward)
    shape_rewards: bool = False  # ref_reward_blend or repr_align


def step_phases(cfg: MRLConfig) -> StepPhases:
    a = cfg.algorithm
    return StepPhases(
        agent=cfg.agent.enable, filter_groups=a.filter_groups.enable, dump_rollout=bool(cfg.trainer.rollout_data_dir),
        remax_baseline=a.adv_estimator == "remax", ref=cfg.ref_enabled, teacher=cfg.teacher.enable,
        values=cfg.critic_enabled, distill_reward=a.distill.mode != "none",
        shape_rewards=a.ref_reward_blend.enable or cfg.repr_align_enabled)


@dataclass(frozen=True)
class RunPlan:
    """What a run does, derived from its config once (see the module docstring)."""

    device: str  # cluster.device with ``auto`` resolved: "cuda" or "cpu"
    dtype: str  # model.dtype with null resolved for the device (bfloat16 on cuda, float32 on cpu)
    layout: dict[str, RoleLayout]  # role -> devices (mrl.config.layout)
    trainer_ranks: int  # Ray rank actors of the actor (and its colocated ref/critic/RM)
    reward_model_ranks: int  # Ray rank actors of a separate reward model (its own group); 0 = none or colocated
    teacher_ranks: int  # Ray rank actors of a separate teacher (its own group); 0 = none or colocated
    ref_ranks: int  # Ray rank actors of a separate reference (ref.placement=separate, its own group); 0 = none or colocated
    gen_batch_size: int  # prompts per generation round (DAPO's data.gen_batch_size when filtering)
    samples_per_prompt: int  # rollout.n: one group of samples per prompt
    samples_per_step: int  # data.train_batch_size * rollout.n
    num_engines: int  # rollout engines (servers) of the run
    actor: UpdatePlan
    critic: UpdatePlan | None  # None without a critic
    free_cache_engine: bool  # engines release device memory while the trainer runs
    log_dir: Path  # engine / router logs
    on_policy_shortcut: bool  # the update's own log-probs stand in for the old-log-prob forward
    push_with_update: bool = False  # the update call also loads the in-process engines (push_with_update())
    transport: str = "distributed"  # rollout.weight_sync.transport, auto resolved (mrl/config/auto.py)
    shared_prefix: bool = False  # actor.shared_prefix, auto resolved
    remove_padding: bool = False  # actor.use_remove_padding, auto resolved: packed micro-batches in every role
    attention: tuple[AutoChoice, ...] = ()  # <role>.megatron.attention_backend of each built role, auto resolved
    phases: StepPhases = StepPhases()  # the step's optional phases
    choices: tuple[AutoChoice, ...] = ()  # each auto-resolvable setting: the value used and why (mrl plan prints them)
    total_steps: int | None = None  # run length (run_length()); None only where the training rows are unknown

    def attention_backend(self, role: str) -> str:
        """``te`` | ``sdpa`` | ``local`` of ``role`` (actor, ref, critic, reward_model, teacher)."""
        return backend_of(self.attention, role)


def on_policy_blockers(cfg: MRLConfig) -> list[str]:
    """Why the on-policy shortcut (actor.on_policy_shortcut) cannot apply: [] when it can.

    It is exact only when log π_old is read by nothing but the one optimizer step that starts from
    π_old: then π_old = π_θ at that step, and ``exp(log π_θ − sg(log π_θ))`` has the value 1 and the
    gradient of the recomputed ratio (docs/driver.md, "On-policy shortcut")."""
    a, al = cfg.actor, cfg.algorithm
    mini = update_plan(cfg, a.ppo_mini_batch_size, a.ppo_epochs, None).mini_batches_per_step
    out = []
    if a.ppo_epochs > 1:
        out.append(f"actor.ppo_epochs={a.ppo_epochs} (later epochs step from an updated policy)")
    if mini > 1:
        out.append(f"data.train_batch_size={cfg.data.train_batch_size} / actor.ppo_mini_batch_size="
                   f"{a.ppo_mini_batch_size} = {mini} mini-batches (later ones step from an updated policy)")
    if al.use_kl_in_reward:
        out.append("algorithm.use_kl_in_reward=true (reads log pi_old before the update)")
    if cfg.repr_align_enabled:
        out.append("algorithm.repr_align (its gate reads the old policy's entropy before the update)")
    if al.distill.mode == "reverse_kl_reward":
        out.append("algorithm.distill.mode=reverse_kl_reward (its reward reads log pi_old before the update)")
    if al.rollout_correction.enabled:
        out.append("algorithm.rollout_correction (its weights and rejection mask read log pi_old before the update)")
    if a.moe.routing_replay == "old":
        out.append("actor.moe.routing_replay=old (records the routing in the old-log-prob forward for the update "
                   "to replay)")
    if cfg.trainer.async_training.max_staleness:
        out.append(f"trainer.async_training.max_staleness={cfg.trainer.async_training.max_staleness} "
                   "(samples of older policies: pi_old is not pi_theta)")
    return out


def on_policy_shortcut(cfg: MRLConfig) -> bool:
    """actor.on_policy_shortcut resolved: null = on where nothing blocks it (check_config refuses true then)."""
    want = cfg.actor.on_policy_shortcut
    return want is not False and not on_policy_blockers(cfg)


def push_with_update(cfg: MRLConfig, device: str) -> bool:
    """transport=inprocess with the on-policy shortcut (and engines that keep their memory): the update call
    loads the new weights into each rank's own engine too, one Ray round trip per step instead of two."""
    return (on_policy_shortcut(cfg) and resolve_transport(cfg, device).value == "inprocess"
            and not free_cache_engine(cfg, device))


def free_cache_engine(cfg: MRLConfig, device: str) -> bool:
    """verl's free_cache_engine: colocated CUDA engines give the device to the trainer by default."""
    r = cfg.rollout
    return r.free_cache_engine if r.free_cache_engine is not None else (r.placement == "colocated" and device == "cuda")


def gen_batch_size(cfg: MRLConfig) -> int:
    """Prompts per generation round: DAPO's data.gen_batch_size (null: data.train_batch_size) when
    algorithm.filter_groups is on, else data.train_batch_size."""
    d = cfg.data
    return (d.gen_batch_size or d.train_batch_size) if cfg.algorithm.filter_groups.enable else d.train_batch_size


def _group_ranks(layout: dict[str, RoleLayout]) -> tuple[int, int, int, int]:
    """Ray rank actors of the trainer group, a separate reward model's, a separate teacher's and a separate
    reference's (0: none)."""
    def own(role: str) -> int:
        r = layout.get(role)
        return r.count if r is not None and not r.colocated else 0

    return layout["actor"].count, own("reward_model"), own("teacher"), own("ref")


def _num_engines(cfg: MRLConfig, layout: dict[str, RoleLayout]) -> int:
    return layout["rollout"].count // cfg.rollout.engine_tp_size


def ray_actors(cfg: MRLConfig) -> tuple[int, int]:
    """Ray actors that each hold a CPU: (every group's rank actors, the launcher actors of separate engines;
    colocated engines' launchers live in the ranks' placement bundles)."""
    layout = compute_layout(cfg)
    return sum(_group_ranks(layout)), _num_engines(cfg, layout) if cfg.rollout.placement == "separate" else 0


def run_length(cfg: MRLConfig, batches_per_epoch: int | None) -> int | None:
    """RL steps of the run: trainer.total_training_steps, else total_epochs x the sampler's batches per epoch
    (verl: len(train_dataloader) x total_epochs); None when the batches per epoch are not known (no data yet)."""
    t = cfg.trainer
    if t.total_training_steps:
        return t.total_training_steps
    return t.total_epochs * batches_per_epoch if batches_per_epoch is not None else None


def update_plan(cfg: MRLConfig, mini_batch_prompts: int, epochs: int, steps: int | None,
                schedule_steps: int | None = None) -> UpdatePlan:
    """``steps``: the run length; ``schedule_steps``: <role>.optim.total_training_steps, an LR schedule
    spanning other than the run (null: the run length, what verl fills in)."""
    mini = max(1, cfg.data.train_batch_size // mini_batch_prompts)
    steps = schedule_steps or steps
    return UpdatePlan(mini_batch_size_samples=mini_batch_prompts * cfg.rollout.n, mini_batches_per_step=mini,
                      epochs=epochs, total_optimizer_steps=steps * mini * epochs if steps else None)


def plan_run(cfg: MRLConfig, device: str, batches_per_epoch: int | None = None) -> RunPlan:
    """The plan of ``cfg`` on ``device`` (``cluster.device``, or what ``auto`` resolved to).
    ``batches_per_epoch``: the data sampler's, once the training set is loaded (``mrl train``), which fixes
    the run length and so the LR schedules' length."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"plan_run needs a resolved device ('cuda' or 'cpu'), got {device!r}")
    a, c = cfg.actor, cfg.critic
    layout = compute_layout(cfg)
    choices = resolve_all(cfg, device)
    transport, shared_prefix, remove_padding = choices[0], choices[1], choices[-1]
    attention = choices[2:-1]
    trainer_ranks, reward_model_ranks, teacher_ranks, ref_ranks = _group_ranks(layout)
    steps = run_length(cfg, batches_per_epoch)
    critic = None
    if cfg.critic_enabled:
        critic = update_plan(cfg, c.ppo_mini_batch_size or a.ppo_mini_batch_size, c.ppo_epochs or a.ppo_epochs, steps,
                             c.optim.total_training_steps)
    return RunPlan(
        device=device,
        dtype=cfg.model.compute_dtype(device),
        layout=layout,
        trainer_ranks=trainer_ranks,
        reward_model_ranks=reward_model_ranks,
        teacher_ranks=teacher_ranks,
        ref_ranks=ref_ranks,
        gen_batch_size=gen_batch_size(cfg),
        samples_per_prompt=cfg.rollout.n,
        samples_per_step=cfg.data.train_batch_size * cfg.rollout.n,
        num_engines=_num_engines(cfg, layout),
        actor=update_plan(cfg, a.ppo_mini_batch_size, a.ppo_epochs, steps, a.optim.total_training_steps),
        critic=critic,
        free_cache_engine=free_cache_engine(cfg, device),
        log_dir=Path(cfg.trainer.checkpoint_dir or "outputs") / "logs",
        on_policy_shortcut=on_policy_shortcut(cfg),
        push_with_update=push_with_update(cfg, device),
        transport=transport.value,
        shared_prefix=shared_prefix.value,
        remove_padding=remove_padding.value,
        attention=attention,
        choices=choices,
        phases=step_phases(cfg),
        total_steps=steps,
    )
