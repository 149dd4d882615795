"""Plan-time checks of a hybrid-attention model (Qwen3.5: Gated DeltaNet linear-attention layers beside gated
attention layers; :mod:`mrl.megatron.gated_delta_net`). No torch: reads config.json through :mod:`mrl.config.auto`.
LoRA (:mod:`mrl.megatron.lora`) adapts the gated attention and the Gated DeltaNet projections; a target name the model
does not have (Qwen3-Next's grouped ``in_proj_qkvz`` on a Qwen3.5, a Gated DeltaNet name on a model without those
layers) is refused by :func:`lora_target_problem` for every model.

A Gated DeltaNet layer runs a recurrence over each whole sequence on one rank, so what splits or branches a sequence
is refused for such a model: context parallelism (the sequence split over ranks; refused with the other CP cases by
:func:`mrl.config.validate_parallel.context_parallel_problem`), sequence parallelism (the
activations split over TP along the sequence), the shared-prefix rows (several samples branching off one prompt
inside a row) and the te / local attention backends (mrl builds these layers on Megatron's local spec only). The plan
says which kernel runs the delta rule. :func:`check_dsa`: the same kind of checks for DeepSeek sparse attention.
"""
from __future__ import annotations

from mrl.config.auto import POLICY_ROLES, megatron_roles, model_is_dsa, model_is_hybrid
from mrl.config.hf import ModelShape
from mrl.config.lora import GATED_DELTA_NET, model_projections
from mrl.config.root import MRLConfig


def lora_target_problem(cfg: MRLConfig, shape: ModelShape | None) -> str | None:
    """actor.lora.target_modules naming a projection that model.path's layers do not have (peft would find no such
    module on the HF model; the adapters would silently not exist), or None."""
    lo = cfg.actor.lora
    if shape is None or not lo.enabled or "all-linear" in lo.target_modules:
        return None
    has = model_projections(shape.linear_layers, shape.model_type)
    lacks = [t for t in lo.target_modules if t not in has]
    if not lacks:
        return None
    gdn = [t for t in has if t in GATED_DELTA_NET]
    what = (f"its Gated DeltaNet layers name theirs {','.join(gdn)}" if gdn else "it has no Gated DeltaNet layers")
    return (f"actor.lora.target_modules={list(lo.target_modules)} names {','.join(lacks)}, which "
            f"{cfg.model.path} ({shape.model_type}) does not have ({what}); fix: target_modules from "
            f"{','.join(has)} or [all-linear]")


def check_hybrid(cfg: MRLConfig, cuda: bool, errors: list[str], notes: list[str]) -> None:
    if not model_is_hybrid(cfg):
        return
    why = f"{cfg.model.path} has Gated DeltaNet layers, which run over each whole sequence on one rank"
    for role, par, _lora in megatron_roles(cfg):
        if role not in POLICY_ROLES:
            continue
        key = f"{role}.megatron"
        if par.sequence_parallel:
            errors.append(f"{key}.sequence_parallel=true: {why}; fix: {key}.sequence_parallel=false")
        if par.attention_backend in ("te", "local"):
            errors.append(f"{key}.attention_backend={par.attention_backend}: mrl builds the Gated DeltaNet layers on "
                          f"Megatron's local spec with SDPA attention only; fix: {key}.attention_backend=sdpa (or auto)")
    if cfg.actor.lora.enabled:
        from mrl.config.auto import _model_shape

        shape = _model_shape(cfg)
        has = model_projections(shape.linear_layers, shape.model_type) if shape is not None else ()
        adapted = [t for t in cfg.actor.lora.targets if t in has]
        notes.append(f"actor.lora on a hybrid decoder: adapters on {','.join(adapted)} (a gated q_proj's query and "
                     "gate halves alike); the Gated DeltaNet conv1d, A_log, dt_bias and gated norm stay frozen "
                     "(not linears; peft leaves them too)")
    if cfg.actor.shared_prefix is True:
        errors.append(f"actor.shared_prefix=true: {why}, and a shared-prefix row branches several samples off one "
                      "prompt inside the row; fix: actor.shared_prefix=false (or auto)")
    kernel = ("fla's chunk_gated_delta_rule (varlen over packed rows) on ranks where the fla package imports, else "
              "mrl's torch chunked kernel per sequence" if cuda else "mrl's torch chunked kernel, per sequence")
    notes.append(f"Gated DeltaNet kernel: {kernel} (mrl/megatron/delta_rule.py)")


def check_dsa(cfg: MRLConfig, errors: list[str]) -> None:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5; :mod:`mrl.megatron.dsa`): its indexer selects over whole causal
    rows, so the shared-prefix layout (several samples' segments under one mask) is refused, and selective recompute
    (Megatron's MLA recomputes the core attention without the indexer's inputs); CP is refused with the other CP
    cases (:func:`mrl.config.validate_parallel.context_parallel_problem`)."""
    if not model_is_dsa(cfg):
        return
    for role in ("actor", "critic"):
        if getattr(cfg, role).recompute_granularity == "selective":
            # Megatron's MLA recomputes its core attention without the indexer's inputs (x, the query latent)
            errors.append(f"{role}.recompute_granularity=selective: {cfg.model.path} has DeepSeek sparse attention, "
                          "whose core attention Megatron's MLA cannot recompute alone (it drops the indexer's "
                          f"inputs); fix: {role}.recompute_granularity=full (or null)")
    if cfg.actor.shared_prefix is True:
        errors.append(f"actor.shared_prefix=true: {cfg.model.path} has DeepSeek sparse attention, whose indexer picks "
                      "its top-k over whole causal rows, not a shared-prefix row's masked segments; fix: "
                      "actor.shared_prefix=false (or auto)")
