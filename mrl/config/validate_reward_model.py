"""Plan-time rules of the reward model across sections: its class, placement and devices, tokenizer and chat
template against the actor's, and how its score combines with reward.function (docs/reward_model.md)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from mrl.config.parallel import ParallelConfig

if TYPE_CHECKING:
    from mrl.config.root import MRLConfig


def check_reward_model(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    """Plan-time checks of ``reward_model`` (reads config.json only)."""
    rm = cfg.reward_model
    if not rm.enable:
        return
    if not rm.model.path:
        errors.append("reward_model.enable=true but reward_model.model.path is not set; "
                      "fix: reward_model.model.path=<HF *ForSequenceClassification checkpoint>")
        return
    conf = Path(rm.model.path) / "config.json"
    if not conf.is_file():
        if not Path(rm.model.path).exists():  # an existing non-model path is preflight's error
            notes.append(f"reward_model.model.path={rm.model.path!r} does not exist here (yet); the run needs it")
    else:
        try:
            archs = json.loads(conf.read_text()).get("architectures") or []
        except (OSError, ValueError) as e:
            errors.append(f"reward_model.model.path: {conf} is unreadable ({e}); fix: point it at a HF checkpoint")
            return
        if len(archs) != 1 or not archs[0].endswith("ForSequenceClassification"):
            errors.append(f"reward_model.model.path={rm.model.path!r} has architectures {archs}, not a "
                          "*ForSequenceClassification reward model; fix: a checkpoint saved from e.g. "
                          "Qwen2ForSequenceClassification with num_labels=1")
    if cfg.algorithm.adv_estimator == "remax":
        errors.append("reward_model.enable=true with algorithm.adv_estimator=remax: the greedy baseline is scored "
                      "by reward.function only, so baseline and samples would use different rewards; "
                      "fix: another estimator, or reward_model.enable=false")
    _check_rm_placement(cfg, errors, notes)
    _check_tokenizers(cfg, errors, notes)
    if rm.combine == "function" and ":" not in cfg.reward.function:
        errors.append(f"reward_model.combine=function but reward.function={cfg.reward.function!r} is a built-in scorer, "
                      "which ignores extra_info['rm_score'] (the RM would not count); fix: reward.function="
                      "path/to/file.py:fn reading extra_info['rm_score'], or reward_model.combine=rm | rule+rm")
    if rm.combine == "rm":
        notes.append(f"reward_model.combine=rm: the reward model's score is the reward, in training and validation; "
                     f"reward.function={cfg.reward.function!r} is not called")


def _check_rm_placement(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    """Rules only the RM has (the device arithmetic and TP/PP against its own config.json are
    validate.py's, shared with the other roles)."""
    rm, actor = cfg.reward_model, cfg.actor.megatron
    if rm.placement == "colocated":
        if rm.megatron is not None and rm.megatron != actor:
            diff = [f"reward_model.megatron.{k}={getattr(rm.megatron, k)} (actor {getattr(actor, k)})"
                    for k in ParallelConfig.model_fields if getattr(rm.megatron, k) != getattr(actor, k)]
            errors.append("reward_model.megatron differs from actor.megatron in " + ", ".join(diff) + ": a colocated "
                          "reward model runs on the actor's ranks in its Megatron groups; fix: remove "
                          "reward_model.megatron (colocated uses actor.megatron), or reward_model.placement=separate "
                          "with reward_model.num_devices=<devices> for a layout of its own")
        notes.append(f"reward_model: colocated with the actor (its ranks, TP={actor.tensor_model_parallel_size} "
                     f"PP={actor.pipeline_model_parallel_size}, micro-batches of {rm.micro_batch_size_per_gpu} samples); "
                     + ("its weights are offloaded to host memory outside phase rm_score" if rm.offload
                        else "its weights stay on the device (reward_model.offload=true frees them between phases)"))
        return
    if rm.offload:
        # Nothing else runs on a separate RM's devices: freeing them between phases gains nothing,
        # and a flag that silently does nothing is worse than an error.
        errors.append("reward_model.offload=true is not supported with reward_model.placement=separate (the RM owns "
                      "its devices, nothing else uses them between phases); fix: reward_model.offload=false, or "
                      "reward_model.placement=colocated to share the actor's devices and offload between phases")
    par = rm.parallel(cfg.actor.megatron)
    # context_parallel_size > 1 (its own or, when reward_model.megatron is null, the actor's): what it cannot run
    # with is said for every role by validate_parallel.check_context_parallel, in one wording
    notes.append(f"reward_model: separate, {rm.num_devices} device(s) of its own after the actor's, "
                 f"TP={par.tensor_model_parallel_size} PP={par.pipeline_model_parallel_size}"
                 + ("" if rm.megatron is not None else " (actor.megatron's sizes: reward_model.megatron is null)")
                 + f", micro-batches of {rm.micro_batch_size_per_gpu} samples")


def _tokenizer_dir_has_template(path: Path) -> bool | None:
    """Whether the tokenizer in ``path`` has a chat template; None when it has no tokenizer files."""
    conf = path / "tokenizer_config.json"
    if not conf.is_file():
        return None
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads(conf.read_text()).get("chat_template"))
    except (OSError, ValueError):
        return None


def _vocab_size(path: Path) -> int | None:
    try:
        return int(json.loads((path / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_tokenizers(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    """input_tokenizer must be the actor's tokenizer (the batch's ids are decoded with it) and the RM's
    checkpoint must carry a tokenizer with a chat template; without it, the vocabularies must agree."""
    rm = cfg.reward_model
    actor_tok = cfg.model.tokenizer_path or cfg.model.path
    path = Path(str(rm.model.path))
    if rm.model.input_tokenizer is None:
        if rm.max_length is not None:
            errors.append(f"reward_model.max_length={rm.max_length} is set but only bounds re-rendered inputs "
                          "(reward_model.model.input_tokenizer set); fix: remove reward_model.max_length, or set "
                          f"reward_model.model.input_tokenizer={actor_tok}")
        ours, theirs = _vocab_size(Path(str(cfg.model.path))), _vocab_size(path)
        if ours is not None and theirs is not None and ours != theirs:
            errors.append(f"reward_model.model.path={rm.model.path!r} has vocab_size {theirs}, the actor's model "
                          f"{ours}: it cannot read the actor's token ids; fix: reward_model.model.input_tokenizer="
                          f"{actor_tok} (responses are re-rendered with the RM's own tokenizer and chat template)")
        return
    if actor_tok and Path(rm.model.input_tokenizer).resolve() != Path(actor_tok).resolve():
        errors.append(f"reward_model.model.input_tokenizer={rm.model.input_tokenizer!r} is not the actor's tokenizer "
                      f"({actor_tok!r}, model.tokenizer_path or model.path), which made the batch's token ids; "
                      f"fix: reward_model.model.input_tokenizer={actor_tok}")
    if (path / "config.json").is_file():
        has = _tokenizer_dir_has_template(path)
        if has is None:
            errors.append(f"reward_model.model.input_tokenizer is set but reward_model.model.path={rm.model.path!r} "
                          "has no tokenizer (tokenizer_config.json); fix: save the RM's tokenizer next to its weights")
        elif not has:
            errors.append(f"reward_model.model.input_tokenizer is set but the tokenizer in reward_model.model.path="
                          f"{rm.model.path!r} has no chat template to re-render the conversation with; fix: add its "
                          "chat_template, or reward_model.model.input_tokenizer=null if it shares the actor's tokenizer")
    notes.append("reward_model.model.input_tokenizer: responses are decoded with the actor's tokenizer and re-rendered "
                 "with the RM's chat template before scoring" + (f" (at most {rm.max_length} tokens, cut on the right)"
                                                                if rm.max_length else ""))
