"""Layout rules every Megatron role shares: its TP*PP*CP against its devices and flags, and its TP/PP/EP
against the model's own config.json (heads, KV heads, layers, experts). Used by validate.py for the actor,
reference, critic and reward model and by validate_teacher.py for the teacher.

Context parallelism (CP > 1) runs for every Megatron role (actor, reference colocated or separate, critic,
teacher, reward model) on the sdpa backend with packed rows (:mod:`mrl.megatron.context_parallel`; the reward
model packs its rows under CP whatever actor.use_remove_padding says); :func:`check_context_parallel` refuses
every other combination, naming why, before anything starts (mrl/workers/megatron_model.py keeps runtime guards as
the last defence)."""
from __future__ import annotations

from mrl.config.hf import ModelShape
from mrl.config.layout import RoleLayout
from mrl.config.parallel import UNEVEN_KEYS, ParallelConfig
from mrl.config.pipeline_split import SplitError, stage_layer_counts, suggest_split
from mrl.config.root import MRLConfig

#: The sizes that define Megatron's process groups: a role sharing the actor's groups must match them.
GROUP_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", *UNEVEN_KEYS)

#: The sections that hold a Megatron layout (teacher's and reward_model's may be null: the actor's sizes).
MEGATRON_ROLES = ("actor", "ref", "critic", "teacher", "reward_model")


def context_parallel_problem(role: str, cfg: MRLConfig, shape: ModelShape | None, choices: dict[str, object]
                             ) -> str | None:
    """Why ``<role>`` cannot run its context_parallel_size > 1 here (None: it can). ``choices``: the resolved
    ``auto`` settings by key (:func:`mrl.config.auto.resolve_all`)."""
    backend = choices.get(f"{role}.megatron.attention_backend", "sdpa")
    if backend != "sdpa":
        return (f"context parallelism runs on the sdpa attention backend only ({role}.megatron.attention_backend "
                f"resolves to {backend}; Transformer Engine's own CP is not wired)")
    if role != "reward_model" and not choices.get("actor.use_remove_padding"):  # the RM packs under CP itself
        return "context parallelism cuts packed rows: it needs actor.use_remove_padding (and no actor.shared_prefix)"
    if shape is not None and shape.dsa is not None:
        return "DeepSeek sparse attention's indexer selects its top-k over each whole sequence on one rank (not under CP)"
    if shape is not None and shape.linear_layers:
        return ("the model's Gated DeltaNet layers run a recurrence over each whole sequence on one rank (no "
                "context-parallel delta rule yet)")
    if cfg.algorithm.repr_align.enable:
        return "algorithm.repr_align reads hidden states, which CP splits over ranks"
    return None


def check_context_parallel(cfg: MRLConfig, shape: ModelShape | None, device: str, errors: list[str]) -> None:
    """One error per role that would run context_parallel_size > 1 where mrl cannot (:func:`context_parallel_problem`):
    its own ``megatron`` section, or a null teacher/reward_model section taking the actor's sizes (said once, on
    the actor's key, only when that role is enabled)."""
    from mrl.config.auto import resolve_all

    choices = {c.key: c.value for c in resolve_all(cfg, device)}
    said = False
    for role in MEGATRON_ROLES:
        own = getattr(cfg, role).megatron
        par = own if own is not None else cfg.actor.megatron
        if par.context_parallel_size <= 1 or (own is None and role not in ("teacher", "reward_model")):
            continue
        if role in ("ref", "critic") and not _builds(cfg, role) or role in ("teacher", "reward_model") and not \
                getattr(cfg, role).enable:
            continue
        why = context_parallel_problem(role, cfg, shape, choices)
        if why is None or own is None and said:
            continue
        key = f"{role if own is not None else 'actor'}.megatron.context_parallel_size"
        said = said or own is None
        errors.append(f"{key}={par.context_parallel_size}: {why}; fix: {key}=1" + (
            "" if own is not None else f" (or a {role}.megatron section of its own with context_parallel_size=1)"))


def _builds(cfg: MRLConfig, role: str) -> bool:
    """Whether the run builds the reference / critic (their sections may be set and unused)."""
    return cfg.critic_enabled if role == "critic" else cfg.ref_enabled


def check_separate_layout(role: str, what: str, megatron: ParallelConfig | None, lay: RoleLayout, cfg: MRLConfig,
                          errors: list[str]) -> None:
    """A separate role's layout on its own ``lay.count`` devices: ``<role>.megatron`` when set, else the actor's
    sizes (whose flag checks ran for the actor), which must then divide the role's devices. ``what``: its name
    in messages ("reward model", "teacher")."""
    if lay.count == 0:
        return
    if megatron is not None:
        check_parallel(role, lay.parallel, lay, cfg, None, errors)
        return
    mp = lay.parallel.model_parallel_size
    if lay.count % mp:
        errors.append(f"{role}.megatron is null, so the separate {what} takes actor.megatron's TP*PP*CP = {mp}, which "
                      f"does not divide {role}.num_devices={lay.count}; fix: set {role}.megatron."
                      f"tensor_model_parallel_size/pipeline_model_parallel_size (their product dividing {lay.count}), "
                      f"or {role}.num_devices to a multiple of {mp}")


def check_parallel(role: str, par: ParallelConfig, lay: RoleLayout, cfg: MRLConfig,
                    shape: ModelShape | None, errors: list[str]) -> None:
    mp = par.model_parallel_size
    key = f"{role}.megatron"
    if lay.count and lay.count % mp:
        errors.append(
            f"{key}: TP*PP*CP = {par.tensor_model_parallel_size}*{par.pipeline_model_parallel_size}*"
            f"{par.context_parallel_size} = {mp} does not divide the {lay.count} devices of the {role}; "
            f"fix: change {key}.tensor_model_parallel_size/pipeline_model_parallel_size/context_parallel_size"
        )
    tp, pp, vpp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    if par.sequence_parallel and tp == 1:
        errors.append(f"{key}.sequence_parallel=true needs tensor_model_parallel_size > 1; fix: set {key}.sequence_parallel=false")
    if vpp is not None and pp == 1:
        errors.append(f"{key}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1; fix: set it to null")
    if cfg.cluster.device != "cpu" and tp > cfg.cluster.n_gpus_per_node:
        errors.append(
            f"{key}.tensor_model_parallel_size={tp} spans nodes (cluster.n_gpus_per_node={cfg.cluster.n_gpus_per_node}); "
            "fix: keep TP within a node and use pipeline_model_parallel_size across nodes"
        )
    if shape is not None:
        check_model_fits(key, par, shape, f"{cfg.model.path}/config.json", errors)


def check_model_fits(key: str, par: ParallelConfig, shape: ModelShape, source: str, errors: list[str]) -> None:
    """``par`` (the layout at ``key``) shards the model of ``source`` (its config.json): heads by TP, layers by PP."""
    tp = par.tensor_model_parallel_size
    if shape.num_heads % tp:
        errors.append(
            f"{key}.tensor_model_parallel_size={tp} does not divide the model's {shape.num_heads} attention heads "
            f"({source} num_attention_heads); fix: choose a TP that divides {shape.num_heads}"
        )
    if shape.num_kv_heads % tp:
        errors.append(
            f"{key}.tensor_model_parallel_size={tp} does not divide the model's {shape.num_kv_heads} KV heads "
            f"({source} num_key_value_heads); fix: choose a TP that divides {shape.num_kv_heads}"
        )
    check_pipeline_split(key, par, shape.num_layers, source, errors)
    ep = par.expert_model_parallel_size
    if ep > 1 and (not shape.num_experts or shape.num_experts % ep):
        experts = f"{shape.num_experts} experts" if shape.num_experts else "no experts (dense)"
        errors.append(
            f"{key}.expert_model_parallel_size={ep} must divide the model's number of experts, but it has {experts}; "
            f"fix: set {key}.expert_model_parallel_size=1 for dense models or a divisor of the expert count"
        )


def check_pipeline_split(key: str, par: ParallelConfig, num_layers: int, source: str, errors: list[str]) -> None:
    """The model's ``num_layers`` split over ``par``'s pipeline stages as Megatron will (even, or uneven with
    num_layers_in_first/last_pipeline_stage; mrl/config/pipeline_split.py); an error names a split that works."""
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    try:
        stage_layer_counts(num_layers, pp, vpp, par.num_layers_in_first_pipeline_stage,
                           par.num_layers_in_last_pipeline_stage)
    except SplitError as e:
        uneven = par.uneven_stages
        where = "".join(f"{key}.{k}={v}, " for k, v in uneven.items())
        if uneven and pp == 1:
            fix = f"set {' and '.join(f'{key}.{k}' for k in uneven)} to null, or pipeline_model_parallel_size > 1"
        else:
            fixes = [f"choose PP{' (x VPP)' if vpp else ''} dividing {num_layers}"]
            hint = suggest_split(num_layers, pp) if vpp is None else None
            if hint:
                fixes.append(", ".join(f"{key}.{k}={v}" for k, v in hint.items())
                             + "".join(f" with {k} null" for k in UNEVEN_KEYS if k not in hint and k in uneven))
            elif vpp:
                fixes.append("first/last stage layer counts that divide by VPP, leaving layers that split evenly "
                             "over the other stages' VPP chunks")
            fix = " or ".join(fixes)
        errors.append(f"{key}: the {num_layers} layers ({source} num_hidden_layers) cannot be split over "
                      f"pipeline_model_parallel_size={pp}"
                      + (f", virtual_pipeline_model_parallel_size={vpp}" if vpp else "")
                      + f" ({where}{e}); fix: {fix}")
