"""Plan-time refusals of a vision-language ``model.path`` whose vision tower mrl builds (Qwen2.5-VL, Qwen3-VL:
:mod:`mrl.families`, :mod:`mrl.megatron.vision`), before anything starts. Torch-free: reads config.json only.

Refused, one line each, for every Megatron role built from ``model.path`` (actor, reference, critic): sequence
parallelism (the image features are merged into the whole embedding on every TP rank), context parallelism, the
shared-prefix layout (``actor.shared_prefix=true``), and a pipeline split whose first stage lacks Qwen3-VL's
deepstack layers (the first ``len(vision_config.deepstack_visual_indexes)`` decoder layers read the tower's output,
which exists on the first stage only)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mrl.config.root import MRLConfig


def vision_config_of(path: str | None) -> tuple[Any, dict[str, Any]] | None:
    """(family, config.json) of a checkpoint whose family builds a vision tower; None otherwise or unreadable."""
    from mrl.config.checkpoint_files import vision_family

    try:
        cfg = json.loads((Path(path or "") / "config.json").read_text())
    except (OSError, ValueError):
        return None
    fam = vision_family(cfg)
    return None if fam is None else (fam, cfg)


def check_vision_layout(cfg: MRLConfig, errors: list[str]) -> None:
    """The module docstring's refusals (nothing for a text-only model)."""
    from mrl.config.pipeline_split import SplitError, stage_layer_counts

    found = vision_config_of(cfg.model.path)
    if found is None:
        return
    fam, raw = found
    name = (raw.get("architectures") or [fam.name])[0]
    if cfg.actor.shared_prefix is True:
        errors.append(f"actor.shared_prefix=true with the vision-language model.path ({name}): its 3-D positions are "
                      "computed per whole sequence; fix: actor.shared_prefix=false (or auto)")
    n_deep = len((raw.get("vision_config") or {}).get("deepstack_visual_indexes") or []) if fam.vision.deepstack else 0
    layers = int((raw.get("text_config") or {}).get("num_hidden_layers") or 0)
    built = {"actor": True, "ref": cfg.ref_enabled, "critic": cfg.critic_enabled}
    for role in ("actor", "ref", "critic"):
        par = getattr(cfg, role).megatron or cfg.actor.megatron
        if not built[role] or (role != "actor" and getattr(cfg, role).megatron is None):
            continue  # a role without its own section runs the actor's sizes: said once, on the actor's keys
        key = f"{role}.megatron"
        if par.sequence_parallel:
            errors.append(f"{key}.sequence_parallel=true with the vision-language model.path ({name}) is not supported "
                          f"yet (the image features join the whole embedding); fix: {key}.sequence_parallel=false")
        if par.context_parallel_size > 1:
            errors.append(f"{key}.context_parallel_size={par.context_parallel_size} with the vision-language model.path "
                          f"({name}) is not supported; fix: {key}.context_parallel_size=1")
        pp = par.pipeline_model_parallel_size
        if n_deep and pp > 1 and layers:
            try:
                first = stage_layer_counts(layers, pp, par.virtual_pipeline_model_parallel_size,
                                           par.num_layers_in_first_pipeline_stage,
                                           par.num_layers_in_last_pipeline_stage)[0]
            except SplitError:
                continue  # check_parallel reports the split itself
            per_chunk = first // (par.virtual_pipeline_model_parallel_size or 1)
            if per_chunk < n_deep:
                errors.append(f"{key}.pipeline_model_parallel_size={pp}: {name} adds deepstack image features after "
                              f"decoder layers 0..{n_deep - 1}, which must all be on the first pipeline stage (it "
                              f"holds {per_chunk}); fix: {key}.num_layers_in_first_pipeline_stage>={n_deep} or a "
                              "smaller pipeline_model_parallel_size")
