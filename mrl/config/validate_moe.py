"""Cross-section rules of Mixture-of-Experts runs (part of the one validation layer, :mod:`mrl.config.validate`).

Megatron lays experts out on a second grid over the same ranks: ETP × EP × expert-DP × PP, so EP may
fold over TP and DP ranks alike (mrl/megatron/parallel.py). Checked here, before anything starts:
the grid fits the role's devices, EP divides the experts, ETP divides the expert MLP, the
dispatcher handles the layout, routing replay has what it needs (R2's old-log-prob forward: the on-policy
shortcut's blockers, mrl/config/run_plan.py), and MoE settings are not given to
a dense model (where they would silently do nothing).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mrl.config.hf import HUB_SHAPES, ModelShape, family_of_dict
from mrl.config.layout import RoleLayout
from mrl.config.moe import MoEConfig
from mrl.config.root import MRLConfig
from mrl.families import FAMILIES
from mrl.families.views import decoder_dict


def check_moe(cfg: MRLConfig, roles: dict[str, RoleLayout], shape: ModelShape | None, errors: list[str],
              notes: list[str] | None = None) -> None:
    moe = cfg.actor.moe
    dense = shape is not None and not shape.num_experts
    if dense:
        changed = [k for k, v in moe.model_dump().items() if v != MoEConfig.model_fields[k].default]
        if changed:
            errors.append(
                f"actor.moe.{changed[0]} is set but {cfg.model.path}/config.json is a dense model (no experts); "
                f"fix: remove actor.moe.{changed[0]} (it applies to Mixture-of-Experts models only)"
            )
    for role in ("actor", "ref", "critic"):
        lay = roles.get(role)
        if lay is None or lay.count <= 0 or lay.parallel is None:
            continue
        par, key = lay.parallel, f"{role}.megatron"
        ep, etp, pp = par.expert_model_parallel_size, par.etp, par.pipeline_model_parallel_size
        if par.expert_tensor_parallel_size is not None and dense and par.expert_tensor_parallel_size != 1:
            errors.append(f"{key}.expert_tensor_parallel_size is set for a dense model; fix: remove it")
        grid = etp * ep * pp
        if lay.count % grid:
            errors.append(
                f"{key}: the expert grid ETP*EP*PP = {etp}*{ep}*{pp} = {grid} does not divide the {lay.count} devices of "
                f"the {role}; fix: choose expert_model_parallel_size / expert_tensor_parallel_size so that their "
                f"product times PP divides {lay.count}"
            )
        fam = FAMILIES.get(shape.model_type) if shape is not None else None
        if fam is not None and fam.moe is not None and fam.moe.expert_linear_bias and etp > 1:
            errors.append(
                f"{key}.expert_tensor_parallel_size={etp} (it defaults to tensor_model_parallel_size): "
                f"{cfg.model.path}'s experts have biases ({shape.model_type}), which Megatron supports only with "
                f"expert_tensor_parallel_size=1; fix: {key}.expert_tensor_parallel_size=1"
            )
        if shape is not None and shape.num_experts and etp > 1 and shape.expert_ffn_size % etp:
            errors.append(
                f"{key}.expert_tensor_parallel_size={etp} does not divide the expert MLP width {shape.expert_ffn_size} "
                f"({cfg.model.path}/config.json); fix: choose an ETP dividing it (or 1)"
            )
        if ep > 1 and moe.token_dispatcher == "allgather":
            errors.append(
                f"actor.moe.token_dispatcher=allgather with {key}.expert_model_parallel_size={ep}: the all-gather "
                "dispatcher needs equal token counts on every EP rank, which micro-batches of different lengths on "
                "different data-parallel ranks do not have; fix: actor.moe.token_dispatcher=alltoall"
            )
        moe_model = shape is not None and bool(shape.num_experts)
        if moe_model and role != "ref" and par.tensor_model_parallel_size > 1 and not par.sequence_parallel:
            errors.append(
                f"{key}.tensor_model_parallel_size={par.tensor_model_parallel_size} with a Mixture-of-Experts model: "
                f"Megatron trains MoE layers under TP only with sequence parallelism; fix: {key}.sequence_parallel=true "
                "(CUDA with Transformer Engine), or TP=1 with expert_model_parallel_size/pipeline_model_parallel_size "
                "(the CPU path: its torch norms have no sequence-parallel mode)"
            )
    if shape is None or not shape.num_experts:
        return
    if cfg.actor.lora.enabled and shape.mla is not None:
        errors.append(f"actor.lora with {cfg.model.path}'s multi-latent attention (DeepSeek-V3): mrl's adapters wrap "
                      "q/k/v/o and MLP projections, not MLA's latent projections; fix: actor.lora.rank=0 (full "
                      "fine-tuning)")
    elif cfg.actor.lora.enabled:
        _check_moe_lora(cfg, shape, errors, notes if notes is not None else [])
    if moe.routing_replay != "none" and cfg.actor.shared_prefix is True:  # auto: off with replay (config/auto.py)
        errors.append(f"actor.moe.routing_replay={moe.routing_replay} with actor.shared_prefix=true: the replayed expert "
                      "ids follow each sample's own tokens, which the shared-prefix layout merges; fix: "
                      "actor.shared_prefix=false")
    if moe.routing_replay == "rollout" and cfg.agent.enable:
        errors.append("actor.moe.routing_replay=rollout with agent.enable: tool-output tokens were never routed by "
                      "the engine as part of the trajectory; fix: actor.moe.routing_replay=old (R2: the trainer's own "
                      "routing, recorded) or none for agent runs")


MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


def _check_moe_lora(cfg: MRLConfig, shape: ModelShape, errors: list[str], notes: list[str]) -> None:
    """LoRA on an MoE model adapts the attention, the dense MLP layers and the shared experts; the routed experts
    and the router stay frozen (mrl/megatron/lora.py), as peft leaves transformers' fused expert tensors."""
    targets = cfg.actor.lora.targets
    dense = shape.num_layers - (shape.moe_layers if shape.moe_layers is not None else shape.num_layers)
    homes = [f"{dense} dense MLP layer(s)"] if dense else []
    if shape.shared_expert_size:
        homes.append("the shared experts")
    mlp = [t for t in targets if t in MLP_PROJS]
    if targets and len(mlp) == len(targets) and not homes:
        errors.append(f"actor.lora.target_modules={list(cfg.actor.lora.target_modules)} name MLP projections only, "
                      f"and every MLP of {cfg.model.path}/config.json is a layer of routed experts, which take no "
                      "adapters; fix: add attention projections (q_proj,k_proj,v_proj,o_proj) or use [all-linear]")
        return
    where = [w for w in ("attention" if len(mlp) < len(targets) else "", " and ".join(homes) if mlp else "") if w]
    notes.append(f"actor.lora on a Mixture-of-Experts model: adapters on the {' and '.join(where) or 'attention'}; "
                 "the routed experts and the router stay frozen (no adapters on them)")


def _family_config(model_path: str | None) -> tuple[Any, dict[str, Any], str] | None:
    """(family, raw config.json, its file) of model.path, or of mrl's bundled copy for a hub id; None when neither
    is there, the file does not parse (load_shape reports it) or no family owns it."""
    if not model_path:
        return None
    f = Path(model_path) / "config.json"
    if not f.is_file():
        parts = model_path.split("/")
        f = HUB_SHAPES / f"{parts[0]}--{parts[-1]}.json"
        if len(parts) != 2 or not f.is_file():
            return None
    try:
        raw = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    fam = family_of_dict(raw) if isinstance(raw, dict) else None
    # a vision-language checkpoint's decoder fields are in text_config (mrl/families/views.py)
    return None if fam is None else (fam, decoder_dict(raw), str(f))


def family_plan_notes(model_path: str | None, notes: list[str]) -> None:
    """The model family's own plan lines (``Family.plan_notes``: e.g. DeepSeek-V3's frozen score-correction bias
    and skipped multi-token-prediction layers), from model.path/config.json or mrl's bundled copy of it."""
    found = _family_config(model_path)
    if found is not None:
        fam, raw, _ = found
        notes.extend(f"model ({fam.name}): {line}" for line in fam.plan_notes(SimpleNamespace(**raw)))


def family_refusals(model_path: str | None, errors: list[str]) -> None:
    """The family's own refusals (``Family.check``: a router Megatron would compute differently, GLM-4.5's
    ``norm_topk_prob=false`` or group scoring), here before anything starts instead of on the ranks. The
    config.json is read as transformers' attribute maps name it (``n_routed_experts`` is ``num_local_experts``)."""
    found = _family_config(model_path)
    if found is None:
        return
    fam, raw, where = found
    cfg = SimpleNamespace(**{"num_local_experts": raw.get("n_routed_experts"), **raw})
    try:
        fam.check(cfg)
    except ValueError as e:
        errors.append(f"model.path {where}: {e}")
