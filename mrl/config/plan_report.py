"""``mrl plan``'s report: the run plan's batch arithmetic and role placement (mrl.config.run_plan, on the device
``mrl plan`` assumes) as printed, and a per-device memory estimate.

Batch arithmetic (units in docs/config.md), per training step:
    samples            = data.train_batch_size * rollout.n
    mini-batches       = data.train_batch_size / actor.ppo_mini_batch_size
    optimizer steps    = mini-batches * actor.ppo_epochs
    samples / DP rank  = actor.ppo_mini_batch_size * rollout.n / DP_actor      (per mini-batch)
    micro-batches      = samples / DP rank / actor.ppo_micro_batch_size_per_gpu (dynamic bsz: upper bound
                         ceil(samples/rank * (max_prompt + max_response) / ppo_max_token_len_per_gpu))

Memory per device (Megatron mixed precision, nothing offloaded, activations and KV cache excluded):
    params/device = largest pipeline stage / TP, Megatron vocab padded to a multiple of
                    make_vocab_size_divisible_by * TP; with PP > 1 the last stage holds the output layer
                    (a copy of the embedding when tied); MoE expert weights are divided by EP * TP too.
    actor/critic  = params * (w + 4 [fp32 main grads] + (12 if w < 4 else 8) [fp32 master + Adam m, v] / (DP*CP
                    when use_distributed_optimizer)), w = bytes of model.dtype
    reference     = params * w;  engine = unpadded params / engine_tp_size * w
    reward model  = its params (scalar head; colocated: the actor's TP/PP on the actor's devices; separate:
                    reward_model.megatron on reward_model.num_devices of its own) * bytes of model.dtype
    LoRA actor    = params * w + a * (w + 4 + opt / shard): only the a adapter params/device get grads and
                    Adam state; a = Σ_layers Σ_targets r·in + r·out/TP (column) or r·in/TP + r·out (row).
                    The colocated reference is the same model with adapters off: 0 bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from mrl.config.auto import planned_device
from mrl.config.hf import ModelShape, read_model_shape
from mrl.config.layout import RoleLayout, engine_nodes
from mrl.config.lora import model_projections
from mrl.config.parallel import ParallelConfig
from mrl.config.pipeline_split import SplitError, stage_layer_counts
from mrl.config.root import MRLConfig
from mrl.config.run_plan import RunPlan, plan_run
from mrl.config.validate import check_config, load_shape
from mrl.config.validate_judge import judge_plan_lines
from mrl.dtypes import itemsize

GiB = 1024**3


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron pads V to a multiple of make_vocab_size_divisible_by * TP."""
    m = divisible_by * tp
    return math.ceil(vocab / m) * m


def params_per_device(shape: ModelShape, par: ParallelConfig, divisible_by: int, value_head: bool = False,
                      vision: bool = True) -> int:
    """Parameters on the most loaded device of a Megatron model (largest stage / TP); ``vision``: with a vision
    tower's (whole on every first-stage device: replicated over TP)."""
    tp, pp, ep, etp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size,
                       par.etp)
    v = padded_vocab(shape.vocab_size, divisible_by, tp)
    h = shape.hidden_size
    dense, experts = shape.layer_params()
    per_layer = dense / tp + experts / (ep * etp)
    counts = _stage_layers(shape.num_layers, par)
    embed = v * h / tp + (shape.vision_params if vision else 0)  # the tower runs on the first stage
    head = h if value_head else (v * h / tp if (not shape.tie_word_embeddings or pp > 1) else 0)
    if pp == 1:
        return int(embed + counts[0] * per_layer + h + head)
    first = embed + counts[0] * per_layer
    last = counts[-1] * per_layer + h + head
    middle = max(counts[1:-1], default=0) * per_layer
    return int(max(first, middle, last))


def _stage_summary(counts: list[int]) -> str:
    """``4, 4 x14, 1``-style: runs of equal stage sizes folded."""
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return ", ".join(f"{c}" if n == 1 else f"{c} x{n}" for c, n in runs)


def _stage_layers(num_layers: int, par: ParallelConfig) -> list[int]:
    """Layers per pipeline stage (even or uneven split); a split the plan's checks refuse counts as
    ``ceil(L / PP)`` per stage here (the estimate still prints next to the error)."""
    pp = par.pipeline_model_parallel_size
    try:
        return stage_layer_counts(num_layers, pp, par.virtual_pipeline_model_parallel_size,
                                  par.num_layers_in_first_pipeline_stage, par.num_layers_in_last_pipeline_stage)
    except SplitError:
        return [math.ceil(num_layers / pp)] * pp


@dataclass(frozen=True)
class RoleMemory:
    """Bytes per device of one role, split by kind."""

    weights: int
    grads: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def lora_params_per_device(shape: ModelShape, par: ParallelConfig, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters on the most loaded device (a full stage of layers; see the module doc). A hybrid decoder's
    layers are counted as the model's mix: Gated DeltaNet projections on its linear-attention layers, the (gated)
    attention's on the others."""
    tp = par.tensor_model_parallel_size
    h, q, kv, f = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    gq = q * (2 if shape.attention_output_gate else 1)
    column = {"q_proj": (h, gq), "k_proj": (h, kv), "v_proj": (h, kv), "gate_proj": (h, f), "up_proj": (h, f)}
    row = {"o_proj": (q, h), "down_proj": (f, h)}

    def count(col: dict, rows: dict) -> float:
        return (sum(rank * i + rank * o / tp for t, (i, o) in col.items() if t in targets)
                + sum(rank * i / tp + rank * o for t, (i, o) in rows.items() if t in targets))

    L = shape.num_layers
    all_layers = count(column, row) * L
    if shape.linear_layers and shape.gdn:
        nk, nv, dk, dv, _ = shape.gdn
        kd, vd = nk * dk, nv * dv
        has = model_projections(shape.linear_layers, shape.model_type)
        gdn = count({t: c for t, c in {"in_proj_qkv": (h, 2 * kd + vd), "in_proj_z": (h, vd), "in_proj_b": (h, nv),
                                       "in_proj_a": (h, nv), "in_proj_qkvz": (h, 2 * kd + 2 * vd),
                                       "in_proj_ba": (h, 2 * nv)}.items() if t in has}, {"out_proj": (vd, h)})
        attn = count({k: column[k] for k in ("q_proj", "k_proj", "v_proj")}, {"o_proj": row["o_proj"]})
        all_layers += shape.linear_layers * (gdn - attn)
    return int(all_layers * max(_stage_layers(L, par)) / L)


def trained_memory(shape: ModelShape, par: ParallelConfig, dp: int, dtype: str, distributed_optimizer: bool,
                   divisible_by: int, value_head: bool = False, trainable: int | None = None,
                   frozen_vision: bool = False) -> RoleMemory:
    """Weights + fp32 grads + optimizer state of a trained Megatron role per device (see module doc).
    ``trainable``: LoRA adapter params per device (the rest is frozen: no grads, no optimizer state);
    ``frozen_vision``: a vision tower held but not trained (``actor.freeze_vision_tower``)."""
    p = params_per_device(shape, par, divisible_by, value_head)
    w = itemsize(dtype)
    opt = 12 if w < 4 else 8
    shard = dp * par.context_parallel_size if distributed_optimizer else 1
    t = (p if not frozen_vision else params_per_device(shape, par, divisible_by, value_head, vision=False)) \
        if trainable is None else trainable
    if trainable is None and shape.num_experts and distributed_optimizer:
        # Megatron shards expert parameters' optimizer state over the expert-data-parallel group, EDP =
        # TP*CP*DP / (ETP*EP) (devices / (ETP*EP*PP)), the rest over DP*CP: with EP covering every device of
        # a stage (EDP 1) the experts' Adam states are not sharded at all
        _, experts = shape.layer_params()
        expert_p = int(experts / (par.expert_model_parallel_size * par.etp) * max(_stage_layers(shape.num_layers, par)))
        edp = max(par.tensor_model_parallel_size * par.context_parallel_size * dp
                  // (par.etp * par.expert_model_parallel_size), 1)
        optimizer = int((p - expert_p) * opt / max(shard, 1) + expert_p * opt / edp)
    else:
        optimizer = int(t * opt / max(shard, 1))
    return RoleMemory(weights=(p if trainable is None else p + t) * w, grads=t * 4, optimizer=optimizer)


@dataclass
class PlanReport:
    """Everything ``mrl plan`` prints besides the resolved config (``run``: the RunPlan it reports on)."""

    run: RunPlan  # the run plan on the device ``mrl plan`` assumes (auto.planned_device): the values a run uses
    samples_per_step: int
    mini_batches_per_step: int
    optimizer_steps_per_step: int
    samples_per_dp_rank: int
    micro_batches_per_dp_rank: int
    micro_batches_is_bound: bool
    roles: dict[str, RoleLayout]
    num_engines: int
    memory: dict[str, RoleMemory] = field(default_factory=dict)
    param_count: int | None = None
    active_param_count: int | None = None  # MoE: parameters one token runs through
    num_experts: int = 0
    num_layers: int | None = None  # the model's decoder layers (config.json), for the per-stage split
    experts_per_token: int = 0
    notes: list[str] = field(default_factory=list)
    full_finetune_actor: RoleMemory | None = None  # the actor without LoRA, to show what LoRA saves
    lora_targets: tuple[str, ...] = ()  # actor.lora's target projections that the model has

    def device_total(self) -> dict[str, int]:
        """Bytes on one device of each group of roles sharing devices (colocated roles add up)."""
        groups: dict[str, int] = {}
        for name, mem in self.memory.items():
            lay = self.roles[name]
            key = "actor" if lay.colocated else name
            groups[key] = groups.get(key, 0) + mem.total
        return groups


def build_report(cfg: MRLConfig) -> PlanReport:
    """Derive the plan of a (valid) config; call after :func:`mrl.config.check_config` found no errors."""
    errors: list[str] = []
    shape = load_shape(cfg, errors, [])
    notes = check_config(cfg)[1]
    run = plan_run(cfg, planned_device(cfg))  # the arithmetic the driver and the trainer ranks use
    roles = run.layout
    a = cfg.actor
    actor = roles["actor"]
    dp = max(actor.dp, 1)
    u = run.actor
    per_rank = u.mini_batch_size_samples // dp
    if a.use_dynamic_bsz:
        seq = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        micro, bound = math.ceil(per_rank * seq / a.ppo_max_token_len_per_gpu), True
    else:
        micro, bound = per_rank // (a.ppo_micro_batch_size_per_gpu or per_rank or 1), False
    plan = PlanReport(
        run=run,
        samples_per_step=run.samples_per_step,
        mini_batches_per_step=u.mini_batches_per_step,
        optimizer_steps_per_step=u.mini_batches_per_step * u.epochs,
        samples_per_dp_rank=per_rank,
        micro_batches_per_dp_rank=micro,
        micro_batches_is_bound=bound,
        roles=roles,
        num_engines=run.num_engines,
        notes=notes,
    )
    if shape is None:
        return plan
    plan.param_count = shape.param_count()
    plan.num_layers = shape.num_layers
    plan.active_param_count = shape.param_count(active=True)
    plan.num_experts, plan.experts_per_token = shape.num_experts, shape.experts_per_token
    div, dt = cfg.model.make_vocab_size_divisible_by, plan_dtype(cfg)
    plan.memory["actor"] = trained_memory(shape, a.megatron, dp, dt, a.use_distributed_optimizer, div,
                                          frozen_vision=a.freeze_vision_tower)
    if a.lora.enabled:
        plan.full_finetune_actor = plan.memory["actor"]
        has = model_projections(shape.linear_layers, shape.model_type)
        plan.lora_targets = tuple(t for t in a.lora.targets if t in has)
        plan.memory["actor"] = trained_memory(shape, a.megatron, dp, dt, a.use_distributed_optimizer, div,
                                              trainable=lora_params_per_device(shape, a.megatron, a.lora.rank,
                                                                               a.lora.targets))
    if "ref" in roles:
        p = params_per_device(shape, roles["ref"].parallel, div)
        lora_ref = a.lora.enabled and cfg.ref.placement == "colocated"  # adapters off: no second copy
        plan.memory["ref"] = RoleMemory(weights=0 if lora_ref else p * itemsize(dt))
    if "critic" in roles:
        c = cfg.critic
        plan.memory["critic"] = trained_memory(shape, c.megatron, max(roles["critic"].dp, 1), dt,
                                               c.use_distributed_optimizer, div, value_head=True)
    plan.memory["rollout"] = RoleMemory(weights=int(plan.param_count * itemsize(dt) / cfg.rollout.engine_tp_size))
    _side_models(cfg, plan)
    return plan


def _side_models(cfg: MRLConfig, plan: PlanReport) -> None:
    """Each side model's frozen weights per device at its layout (the actor's when colocated, on the actor's devices;
    <role>.megatron on its own when separate) in model.dtype (null: fp32 on CPU, bf16 on accelerators); a reward
    model has a [1, H] score head in place of the LM head. No estimate when its config.json is absent (check_config
    reports an unreadable one)."""
    for role, side in cfg.rank_side_models().items():
        lay, path = plan.roles.get(role), side.model_dir()
        if lay is None or not path:
            continue
        try:
            shape = read_model_shape(path)
        except ValueError:
            continue
        if shape is not None:
            plan.memory[role] = RoleMemory(weights=params_per_device(
                shape, lay.parallel, cfg.model.make_vocab_size_divisible_by, value_head=side.score_head)
                * itemsize(plan_dtype(cfg)))


def plan_dtype(cfg: MRLConfig) -> str:
    """model.dtype, or its default for cluster.device (``auto`` planned as cuda, where it matters)."""
    return cfg.model.compute_dtype("cpu" if cfg.cluster.device == "cpu" else "cuda")


def _gib(b: int) -> str:
    if b < GiB:
        return f"{b / 1024**2:.1f} MiB"
    return f"{b / GiB:.2f} GiB"


REPLAY_LINES = {  # docs/moe.md, "Routing replay"
    "none": "off, every forward routes on its own",
    "rollout": "R3, the engines' expert choice replayed in the old-log-prob, reference and update forwards",
    "old": "R2, the old-log-prob forward's expert choice recorded and replayed in the update's forwards",
}


def format_report(cfg: MRLConfig, plan: PlanReport) -> str:
    """Human-readable plan (the second half of ``mrl plan``'s output)."""
    a, r, run = cfg.actor, cfg.rollout, plan.run
    per_node = cfg.cluster.n_gpus_per_node
    kind = "CPU ranks" if cfg.cluster.device == "cpu" else "devices"
    lines = [
        "plan:",
        f"  devices: {cfg.cluster.nnodes} node(s) x {per_node} {kind} = {cfg.cluster.world_size} (cluster.device={cfg.cluster.device})",
        (f"  samples per step: {plan.samples_per_step} (data.train_batch_size={cfg.data.train_batch_size} prompts x rollout.n="
        f"{run.samples_per_prompt})"),
        (f"  mini-batches per step: {plan.mini_batches_per_step} (actor.ppo_mini_batch_size={a.ppo_mini_batch_size} prompts"
         f" = {run.actor.mini_batch_size_samples} samples each)"),
        f"  optimizer steps per step: {plan.optimizer_steps_per_step} (x actor.ppo_epochs={a.ppo_epochs})",
        "  old-log-prob forward: " + ("skipped, the update's own log-probs stand in (actor.on_policy_shortcut)"
                                      if run.on_policy_shortcut else "recomputed before the update"),
        f"  samples per actor DP rank per mini-batch: {plan.samples_per_dp_rank}",
        *([f"  routing replay: {REPLAY_LINES[a.moe.routing_replay]} (actor.moe.routing_replay={a.moe.routing_replay})"]
          if plan.num_experts else []),
        (f"  micro-batches per actor DP rank per mini-batch: {'<= ' if plan.micro_batches_is_bound else ''}"
         f"{plan.micro_batches_per_dp_rank}" + (" (dynamic bsz, token budget)" if plan.micro_batches_is_bound else "")),
        "  roles:",
    ]
    for name, lay in plan.roles.items():
        where = lay.nodes(per_node) if lay.count else "none"
        if name == "rollout":
            spans = engine_nodes(cfg)
            desc = f"{plan.num_engines} x {r.engine} engine(s), tp={r.engine_tp_size}" + (
                f" over {spans} nodes each" if spans > 1 else "") + (
                " inside the trainer ranks (weight_sync.transport=inprocess" + (
                    "; each update call also loads the new weights)"
                    if run.push_with_update else ")")
                if run.transport == "inprocess" else "")
        else:
            p = lay.parallel
            desc = (f"TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
                    f"CP={p.context_parallel_size} DP={lay.dp}")
            if p.uneven_stages and plan.num_layers:
                desc += f" | layers per stage: {_stage_summary(_stage_layers(plan.num_layers, p))}"
            if p.context_parallel_size > 1:  # mrl.megatron.context_parallel: zigzag shares of every packed row
                desc += (f" | CP={p.context_parallel_size}: each device holds 1/{p.context_parallel_size} of every "
                         "sequence's tokens and activations (K/V gathered per layer)")
            if p.expert_model_parallel_size > 1 or plan.num_experts:
                edp = lay.count // (p.etp * p.expert_model_parallel_size * p.pipeline_model_parallel_size) if lay.count else 0
                desc += f" | experts: EP={p.expert_model_parallel_size} ETP={p.etp} EDP={edp}"
        share = "colocated with actor" if lay.colocated else "owns these devices"
        lines.append(f"    {name:12s} {lay.count:4d} {kind} [{where}] {desc}; {share}")
    lines.extend(judge_plan_lines(cfg, plan_dtype(cfg)))  # reward.judge: its engines or external server (docs/judge.md)
    if plan.memory:
        model = f"model {plan.param_count / 1e6:.1f}M params"
        if plan.num_experts:
            n = (lambda x: f"{x / 1e9:.2f}B") if plan.param_count >= 1e9 else (lambda x: f"{x / 1e6:.2f}M")
            model = (f"MoE model {n(plan.param_count)} params in all, {n(plan.active_param_count)} active "
                     f"per token ({plan.num_experts} experts, top-{plan.experts_per_token})")
        lines.append(f"  memory per device ({model}, {plan_dtype(cfg)}; activations and KV cache not included):")
        for name, m in plan.memory.items():
            parts = f"weights {_gib(m.weights)}"
            if m.grads:
                parts += f" + grads {_gib(m.grads)} + optimizer {_gib(m.optimizer)}"
            lines.append(f"    {name:12s} {parts} = {_gib(m.total)}")
        for group, total in plan.device_total().items():
            lines.append(f"    total per {group} device if nothing is offloaded: {_gib(total)}")
        full, lo = plan.full_finetune_actor, plan.memory["actor"]
        if full is not None:
            lines.append(
                f"    LoRA rank {a.lora.rank} ({len(plan.lora_targets)} target projections): actor grads + optimizer "
                f"{_gib(lo.grads + lo.optimizer)} instead of {_gib(full.grads + full.optimizer)} (full fine-tuning), "
                f"saves {_gib(full.total - lo.total)} per actor device; reference = base model with adapters off "
                + ("(0 bytes)" if cfg.ref.placement == "colocated" else "(separate copy)"))
    lines.append(f"  chosen for cluster.device={run.device}" + (" (auto: as this host sees it)"
                                                                 if cfg.cluster.device == "auto" else "") + ":")
    lines.extend(f"    {c.line()}" for c in run.choices)
    if plan.notes:
        lines.append("  notes:")
        lines.extend(f"    - {n}" for n in plan.notes)
    return "\n".join(lines)


def plan_text(cfg: MRLConfig) -> str:
    """Resolved config (YAML) + plan, as ``mrl plan`` prints it; cfg must have passed check_config."""
    import yaml

    resolved = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)
    return "# resolved config\n" + resolved + "\n" + format_report(cfg, build_report(cfg))
