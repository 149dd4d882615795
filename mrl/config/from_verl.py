"""``mrl from-verl``: a verl launch command (``python3 -m verl.trainer.main_ppo k=v ...``) as an mrl YAML.

Pure text work (standard library + PyYAML): no Ray, Megatron or verl import. Input is either a shell script
(line continuations joined, ``NAME=value`` / ``export NAME=value`` assignments expanded where the script
defines them: ``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``$((integer arithmetic))``, with bounded
expansion: :mod:`mrl.config.verl_script`) or the Hydra overrides themselves. Each override goes through :data:`KEYS` (verl key -> mrl key, same value),
:data:`CONVERTERS` (verl key -> a function of the value) or :data:`UNMAPPED` (known verl keys with the reason
mrl has no equivalent); any other key is reported as unknown. Hydra's ``+``/``++`` prefixes are dropped.

verl's hybrid engine (actor and rollout on the same GPUs, weights handed over in GPU memory) is mrl's
``rollout.placement=colocated`` with ``rollout.weight_sync.transport=tensor``; the translation says so in
the YAML it writes.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from mrl.config.loader import parse_value
from mrl.config.parallel import UNEVEN_KEYS
from mrl.config.verl_script import expand, logical_lines, overrides_from_script

__all__ = ["Translation", "expand", "logical_lines", "overrides_from_script", "translate", "translate_overrides"]

AR = "actor_rollout_ref."
A, R, REF = AR + "actor.", AR + "rollout.", AR + "ref."

# verl key -> mrl key, the value carried over unchanged.
KEYS: dict[str, str] = {
    # data
    **{f"data.{k}": f"data.{k}" for k in (
        "train_files", "val_files", "prompt_key", "max_prompt_length", "filter_overlong_prompts", "shuffle", "seed",
        "train_batch_size", "val_batch_size", "gen_batch_size", "image_key")},
    "data.max_response_length": "rollout.max_response_length",
    # model
    AR + "model.path": "model.path",
    AR + "model.trust_remote_code": "model.trust_remote_code",
    AR + "model.lora_rank": "actor.lora.rank",
    AR + "model.lora_alpha": "actor.lora.alpha",
    AR + "model.target_modules": "actor.lora.target_modules",
    AR + "model.lora.rank": "actor.lora.rank",  # verl's Megatron LoRA (Megatron-Bridge)
    AR + "model.lora.alpha": "actor.lora.alpha",
    AR + "model.lora.dropout": "actor.lora.dropout",
    AR + "model.lora.target_modules": "actor.lora.target_modules",
    # actor
    **{A + k: "actor." + k for k in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "shuffle", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff", "use_kl_loss",
        "kl_loss_coef", "kl_loss_type", "loss_agg_mode", "tis_imp_ratio_cap")},
    A + "policy_loss.loss_mode": "actor.policy_loss",
    A + "grad_clip": "actor.optim.clip_grad",
    A + "checkpoint.save_contents": "actor.checkpoint.save_contents",
    A + "checkpoint.load_contents": "actor.checkpoint.load_contents",
    **{A + "optim." + k: "actor.optim." + k for k in (
        "lr", "betas", "weight_decay", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio", "clip_grad",
        "total_training_steps")},
    **{A + "megatron." + k: "actor.megatron." + k for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel", "use_distributed_optimizer")},
    **{A + "megatron.override_transformer_config." + k: "actor.megatron." + k for k in UNEVEN_KEYS},
    **{REF + "megatron.override_transformer_config." + k: "ref.megatron." + k for k in UNEVEN_KEYS},
    A + "megatron.param_offload": "actor.offload_param",
    A + "megatron.grad_offload": "actor.offload_grad",
    A + "megatron.optimizer_offload": "actor.offload_optimizer",
    # (*.megatron.context_parallel_size: CONVERTERS, carried over with a note when > 1)
    # reference
    REF + "log_prob_micro_batch_size_per_gpu": "ref.log_prob_micro_batch_size_per_gpu",
    REF + "megatron.param_offload": "ref.offload",
    **{REF + "megatron." + k: "ref.megatron." + k for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")},
    # rollout
    **{R + k: "rollout." + k for k in ("n", "temperature", "top_p", "top_k", "free_cache_engine", "max_num_seqs")},
    R + "tensor_model_parallel_size": "rollout.engine_tp_size",
    R + "gpu_memory_utilization": "rollout.mem_fraction_static",
    R + "log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_gpu",
    **{R + "val_kwargs." + k: "rollout.val_kwargs." + k for k in ("top_k", "top_p", "temperature", "n", "do_sample")},
    # critic
    "critic.model.path": "critic.model_path",
    **{"critic." + k: "critic." + k for k in (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "cliprange_value", "loss_agg_mode")},
    "critic.grad_clip": "critic.optim.clip_grad",
    **{"critic.optim." + k: "critic.optim." + k for k in (
        "lr", "betas", "weight_decay", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio", "clip_grad")},
    **{"critic.megatron." + k: "critic.megatron." + k for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel")},
    "critic.megatron.param_offload": "critic.offload_param",
    "critic.megatron.grad_offload": "critic.offload_grad",
    "critic.megatron.optimizer_offload": "critic.offload_optimizer",
    # reward model
    "reward_model.enable": "reward_model.enable",
    "reward_model.model.path": "reward_model.model.path",
    "reward_model.model.input_tokenizer": "reward_model.model.input_tokenizer",
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size_per_gpu",
    "reward_model.max_length": "reward_model.max_length",
    **{f"reward_model.overlong_buffer.{k}": f"reward.overlong_buffer.{k}" for k in ("enable", "len", "penalty_factor")},
    **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{k}": f"reward.overlong_buffer.{k}"
       for k in ("enable", "len", "penalty_factor")},
    # verl 0.9's reward section (the legacy reward_model.* keys above still parse there)
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.num_workers": "reward.workers",
    # algorithm
    **{f"algorithm.rollout_correction.{k}": f"algorithm.rollout_correction.{k}" for k in (
        "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
        "bypass_mode", "loss_type")},
    **{f"algorithm.{k}": f"algorithm.{k}" for k in (
        "adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty")},
    **{f"algorithm.kl_ctrl.{k}": f"algorithm.kl_ctrl.{k}" for k in ("type", "kl_coef", "target_kl", "horizon")},
    **{f"algorithm.filter_groups.{k}": f"algorithm.filter_groups.{k}" for k in ("enable", "metric", "max_num_gen_batches")},
    # trainer
    "trainer.n_gpus_per_node": "cluster.n_gpus_per_node",
    "trainer.nnodes": "cluster.nnodes",
    **{f"trainer.{k}": f"trainer.{k}" for k in (
        "total_epochs", "total_training_steps", "critic_warmup", "save_freq", "test_freq", "val_before_train", "val_only",
        "log_val_generations", "rollout_data_dir", "validation_data_dir", "default_local_dir", "resume_mode",
        "project_name", "experiment_name")},
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
}


_OTHER_OVERRIDES = ("Megatron TransformerConfig overrides other than num_layers_in_first/last_pipeline_stage (mrl's "
                    "<role>.megatron keys) are not passed through; see docs/config.md for mrl's own keys")


def _long_sequences(role: str) -> str:
    """What mrl offers for long sequences: context parallelism, packing, recompute, sequence parallelism."""
    return (f"to split each sequence over ranks set {role}.megatron.context_parallel_size (context parallelism on the "
            "sdpa attention backend with packed rows, docs/long_context.md); also actor.use_remove_padding, activation "
            f"recompute (actor.recompute_granularity) and TP with {role}.megatron.sequence_parallel=true")


def _ulysses(role: str) -> str:
    return "Ulysses SP is FSDP's; " + _long_sequences(role)


# Known verl keys with no mrl equivalent: key (or key prefix ending in '.') -> why.
_FSDP = "FSDP settings: mrl trains with Megatron-Core (set actor.megatron.* / actor.offload_* instead)"
UNMAPPED: dict[str, str] = {
    A + "fsdp_config.": _FSDP, REF + "fsdp_config.": _FSDP, "critic.model.fsdp_config.": _FSDP, AR + "model.use_shm": _FSDP,
    "critic.fsdp.": _FSDP,
    AR + "model.enable_gradient_checkpointing": "Megatron recompute is actor.recompute_granularity=full|selective; "
                                                "set it if memory needs it (verl's flag has no one-to-one equivalent)",
    "critic.model.enable_gradient_checkpointing": "set critic.recompute_granularity=full|selective if memory needs it",
    AR + "model.use_fused_kernels": "no fused-kernel switch in mrl",
    AR + "model.override_config.": "HF config overrides are not supported: the model's config.json is used as it is",
    AR + "model.lora.": "mrl's LoRA is peft's: rank, alpha, dropout and target_modules (actor.lora.*; docs/lora.md)",
    AR + "model.external_lib": "custom model libraries are not loaded; mrl builds Megatron models from HF configs",
    "critic.model.use_remove_padding": "the critic follows actor.use_remove_padding (one row layout per run)",
    AR + "hybrid_engine": "always the case with rollout.placement=colocated",
    "data.truncation": "mrl drops prompts over data.max_prompt_length (data.filter_overlong_prompts) or refuses them",
    "data.return_raw_chat": "mrl renders chat prompts with the model's template itself (nothing to set)",
    "data.dataloader_num_workers": "the prompt data is loaded once, in the driver (nothing to set)",
    "data.trust_remote_code": "set model.trust_remote_code",
    R + "mode": "verl's sync/async rollout mode has no counterpart: mrl's driver sends HTTP requests to the engines",
    R + "load_format": "weights reach the engines by mrl's weight sync (rollout.weight_sync.*)",
    R + "layered_summon": "an FSDP option (mrl exports Megatron weights bucket by bucket)",
    R + "enforce_eager": "a vLLM option", R + "enable_chunked_prefill": "a vLLM/SGLang server option not exposed by mrl",
    R + "max_num_batched_tokens": "an engine server option not exposed by mrl",
    R + "max_model_len": "the engines take data.max_prompt_length + rollout.max_response_length",
    R + "dtype": "the engines run in model.dtype",
    R + "multi_turn.": "multi-turn rollouts are mrl's agent section (agent.enable, agent.tools; docs/agent.md)",
    R + "calculate_log_probs": "mrl always returns the engines' log-probs (training/rollout_probs_diff_*)",
    R + "agent.": "multi-turn rollouts are mrl's agent section (agent.enable, agent.tools; docs/agent.md)",
    R + "engine_kwargs.": "engine server arguments are not passed through",
    R + "disable_log_stats": "an engine server option", R + "do_sample": "set rollout.temperature (0 = greedy)",
    R + "ignore_eos": "not exposed", R + "response_length": "set data.max_response_length (rollout.max_response_length)",
    R + "prompt_length": "set data.max_prompt_length",
    R + "log_prob_use_dynamic_bsz": "mrl's log-prob passes use the actor's micro-batching (actor.use_dynamic_bsz)",
    R + "log_prob_max_token_len_per_gpu": "mrl's log-prob passes use actor.ppo_max_token_len_per_gpu",
    REF + "log_prob_use_dynamic_bsz": "the reference uses the actor's micro-batching (actor.use_dynamic_bsz)",
    REF + "log_prob_max_token_len_per_gpu": "the reference uses actor.ppo_max_token_len_per_gpu",
    A + "ulysses_sequence_parallel_size": _ulysses("actor"),
    REF + "ulysses_sequence_parallel_size": _ulysses("ref"),
    "critic.ulysses_sequence_parallel_size": _ulysses("critic"),
    A + "megatron.seed": "the seed is trainer.seed", A + "megatron.use_mbridge": "mrl maps HF <-> Megatron weights itself",
    REF + "megatron.seed": "the seed is trainer.seed", REF + "megatron.use_mbridge": "mrl maps HF <-> Megatron weights itself",
    A + "megatron.override_transformer_config.": _OTHER_OVERRIDES,
    REF + "megatron.override_transformer_config.": _OTHER_OVERRIDES,
    A + "profiler.": "profiling is not configurable in mrl", "trainer.profile_steps": "profiling is not configurable in mrl",
    "trainer.balance_batch": "no switch in mrl",
    "trainer.ray_wait_register_center_timeout": "not needed by mrl's Ray setup",
    "trainer.max_critic_ckpt_to_keep": "trainer.max_ckpt_to_keep covers every role",
    "trainer.del_local_ckpt_after_load": "not supported", "trainer.esi_redundant_time": "not supported",
    "trainer.default_hdfs_dir": "HDFS is not supported; checkpoints go to trainer.default_local_dir",
    "reward_model.reward_manager": "mrl's reward manager is one (reward.function, reward.workers, reward.overlong_buffer)",
    "reward_model.strategy": "the reward model runs on Megatron-Core", "reward_model.model.fsdp_config.": _FSDP,
    "reward_model.launch_reward_fn_async": "reward functions run in mrl's process pool (reward.workers)",
    "reward_model.model.use_remove_padding": "the reward model scores padded rows (nothing to set)",
    "reward_model.model.trust_remote_code": "set model.trust_remote_code",
    "reward_model.reward_kwargs.": "extra reward-manager arguments are not passed through",
    "custom_reward_function.reward_kwargs.": "extra reward-function arguments are not passed through",
    "ray_init.": "Ray is started by mrl (cluster.address for an existing cluster)", "ray_kwargs.": "Ray is started by mrl",
    "global_profiler.": "profiling is not configurable in mrl",
    A + "use_torch_compile": "no torch.compile switch in mrl",
    A + "optim.override_optimizer_config.": "Megatron optimizer overrides are not passed through",
    "reward_model.rollout.": "generative reward models (an LLM judge on engines of its own) are not supported; use "
                             "reward.function or a *ForSequenceClassification reward model (reward_model.*)",
    "reward_model.use_reward_loop": "verl's reward loop has no counterpart: rewards come from reward.function / reward_model",
    "reward.reward_model.rollout.": "generative reward models (an LLM judge on engines of its own) are translated by "
                                    "hand: mrl's reward.judge section (docs/judge.md)",
    "reward.reward_manager.": "mrl's reward manager is one (reward.function, reward.workers, reward.overlong_buffer)",
    "reward.sandbox_fusion.": "code execution rewards run in mrl's tool sandbox (agent.tools; docs/agent.md)",
    "reward.custom_reward_function.reward_kwargs.": "extra reward-function arguments are not passed through",
}

# Keys the tables above take that verl 0.9.1's own config schema (verl/trainer/config/_generated_*.yaml) does not
# have, each with where launch scripts still carry it; tests/config/test_from_verl_schema.py checks every other
# key against that schema, and that each key here is indeed absent from it.
OLDER_VERL = "verl <= 0.5's ppo_trainer.yaml (legacy FSDP reward-model worker)"
OUTSIDE_VERL_0_9_1: dict[str, str] = {
    **{role + "megatron.override_transformer_config." + k: (
        "verl's DeepSeek-V3 671B examples (examples/grpo_trainer/run_deepseek671b_math_megatron*.sh: "
        "+actor_rollout_ref.actor.megatron.override_transformer_config." + k + ", a Megatron TransformerConfig field)")
       for role in (A, REF) for k in UNEVEN_KEYS},
    **{k: OLDER_VERL for k in (
        "reward_model.strategy", "reward_model.model.input_tokenizer", "reward_model.micro_batch_size_per_gpu",
        "reward_model.max_length", "reward_model.model.use_remove_padding", "reward_model.model.fsdp_config.",
        "reward_model.launch_reward_fn_async", "reward_model.reward_kwargs.")},
    "critic.model.fsdp_config.": "verl <= 0.5's ppo_trainer.yaml (critic.model.fsdp_config)",
    "ray_init.": "verl <= 0.5's ppo_trainer.yaml (top-level ray_init.num_cpus)",
    "trainer.profile_steps": "verl 0.4-0.5's trainer section (before global_profiler)",
    "reward_model.use_reward_loop": "verl 0.6-0.8 (the reward loop switch)",
    **{f"reward_model.overlong_buffer.{k}": "verl 0.3's DAPO recipe (recipe/dapo scripts)"
       for k in ("enable", "len", "penalty_factor")},
    **{f"reward_model.reward_kwargs.overlong_buffer_cfg.{k}": "verl 0.4+'s DAPO recipe (+reward_model.reward_kwargs...)"
       for k in ("enable", "len", "penalty_factor")},
    "custom_reward_function.reward_kwargs.": "user scripts' +custom_reward_function.reward_kwargs.* (verl passes them "
                                             "to the reward function)",
    "reward.custom_reward_function.reward_kwargs.": "user scripts' +reward.custom_reward_function.reward_kwargs.* "
                                                    "(verl 0.9 passes them to the reward function)",
    AR + "actor.tis_imp_ratio_cap": "verl 0.5-0.6's actor section (TIS, before algorithm.rollout_correction)",
    **{f"{role}megatron.grad_offload": "verl <= 0.4's Megatron config (param/grad/optimizer offload)"
       for role in (A, "critic.")},
}


@dataclass
class Translation:
    """The mrl config (nested dict), and what was not carried over."""

    config: dict[str, Any] = field(default_factory=dict)
    unmapped: list[tuple[str, str, str]] = field(default_factory=list)  # (verl key, value, why)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any) -> None:
        node = self.config
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value

    def get(self, key: str) -> Any:
        node: Any = self.config
        for p in key.split("."):
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node

    def yaml(self) -> str:
        """The mrl YAML, headed by comments naming every key not carried over."""
        head = ["# mrl config translated from a verl launch command by `mrl from-verl`.",
                "# Check it with `mrl plan <this file>`; every key not carried over is listed here."]
        head += [f"# note: {n}" for n in dict.fromkeys(self.notes)]
        if self.unmapped:
            head.append("# not mapped:")
            head += [f"#   {k}={v}: {why}" for k, v, why in self.unmapped]
        body = yaml.safe_dump(self.config, sort_keys=False, default_flow_style=None, width=120)
        return "\n".join(head) + "\n" + body


class Unmappable(ValueError):
    """A value mrl cannot take for this key; the message says why."""


def _warmup_style(t: Translation, v: Any) -> None:
    # verl: optim.warmup_style (constant|cosine) = the schedule after warmup; newer verl: lr_scheduler_type
    if v not in ("constant", "cosine", "linear"):
        raise Unmappable("mrl's schedules are constant, linear and cosine; set actor.optim.lr_schedule")
    t.set("actor.optim.lr_schedule", v)


def _critic_warmup_style(t: Translation, v: Any) -> None:
    if v not in ("constant", "cosine", "linear"):
        raise Unmappable("mrl's schedules are constant, linear and cosine; set critic.optim.lr_schedule")
    t.set("critic.optim.lr_schedule", v)


def _rollout_name(t: Translation, v: Any) -> None:
    if v == "sglang":
        t.set("rollout.engine", "sglang")
        return
    if v in ("vllm", "hf"):
        t.set("rollout.engine", "sglang")
        t.notes.append(f"actor_rollout_ref.rollout.name={v}: mrl's GPU engines are SGLang 0.5.23; the YAML uses "
                       "rollout.engine=sglang (rollout.engine=torch is mrl's built-in engine for small models and CPU)")
        return
    raise Unmappable("mrl's engines are sglang and its built-in torch engine")


def _clip_ratio(t: Translation, v: Any) -> None:
    # verl: clip_ratio is the default of both bounds; an explicit clip_ratio_low/high wins wherever it stands
    for bound in ("actor.clip_ratio_low", "actor.clip_ratio_high"):
        if t.get(bound) is None:
            t.set(bound, v)


def _logger(t: Translation, v: Any) -> None:
    names = v if isinstance(v, list) else [v]
    kept = [n for n in names if n in ("console", "mlflow")]
    dropped = [n for n in names if n not in ("console", "mlflow")]
    t.set("trainer.logger", kept or ["console"])
    if dropped:
        raise Unmappable(f"mrl logs to console and mlflow only; {', '.join(map(str, dropped))} dropped")


def _custom_reward_path(t: Translation, v: Any) -> None:
    t.set("reward.function", f"{v}:{t.get('reward.function') or 'compute_score'}")


def _custom_reward_name(t: Translation, v: Any) -> None:
    cur = t.get("reward.function")
    t.set("reward.function", f"{cur.rsplit(':', 1)[0]}:{v}" if cur and ":" in cur else v)


def _rm_pool_devices(t: Translation, v: Any, key: str) -> None:
    t.set("reward_model.placement", "separate")
    t.notes.append(f"{key}: verl's reward pool is reward_model.placement=separate with reward_model.num_devices="
                   "n_gpus_per_node x nnodes of that pool; check reward_model.num_devices")
    if key.endswith("n_gpus_per_node"):
        t.set("reward_model.num_devices", v)


def _device(t: Translation, v: Any) -> None:
    device = {"cuda": "cuda", "gpu": "cuda", "cpu": "cpu"}.get(str(v).lower())
    if device is None:
        raise Unmappable(f"mrl runs on CUDA GPUs (cluster.device=cuda) or, for development, on CPU "
                         f"(cluster.device=cpu with rollout.engine=torch); not on {v}")
    t.set("cluster.device", device)


def _context_parallel(t: Translation, v: Any, role: str) -> None:
    # carried over as is: mrl plan judges it (sdpa backend, packed rows; refuses the rest naming why)
    if isinstance(v, int) and not isinstance(v, bool) and v > 1:
        t.notes.append(f"{role}.megatron.context_parallel_size={v}: mrl's context parallelism runs on the sdpa attention "
                       "backend with packed rows (actor.use_remove_padding); mrl plan says what it refuses "
                       "(docs/long_context.md)")
    t.set(f"{role}.megatron.context_parallel_size", v)


def _remove_padding(t: Translation, v: Any) -> None:
    # verl's flag (FSDP's packed varlen rows) is mrl's actor.use_remove_padding for every Megatron forward. true
    # becomes auto: mrl packs wherever its attention can (sdpa) and says why not elsewhere (TE's attention, shared
    # prompts), where an explicit true would be refused by mrl plan.
    if v is True:
        t.set("actor.use_remove_padding", "auto")
        t.notes.append("actor_rollout_ref.model.use_remove_padding=True -> actor.use_remove_padding: auto (packed rows "
                       "wherever the attention backend is sdpa; mrl plan prints the choice)")
    else:
        t.set("actor.use_remove_padding", v)


CONVERTERS: dict[str, Callable[[Translation, Any], None]] = {
    "trainer.device": _device,
    AR + "model.use_remove_padding": _remove_padding,
    A + "optim.warmup_style": _warmup_style,
    A + "optim.lr_scheduler_type": _warmup_style,
    "critic.optim.warmup_style": _critic_warmup_style,
    "critic.optim.lr_scheduler_type": _critic_warmup_style,
    R + "name": _rollout_name,
    A + "megatron.context_parallel_size": lambda t, v: _context_parallel(t, v, "actor"),
    REF + "megatron.context_parallel_size": lambda t, v: _context_parallel(t, v, "ref"),
    "critic.megatron.context_parallel_size": lambda t, v: _context_parallel(t, v, "critic"),
    A + "clip_ratio": _clip_ratio,
    "trainer.logger": _logger,
    "custom_reward_function.path": _custom_reward_path,
    "custom_reward_function.name": _custom_reward_name,
    "reward.custom_reward_function.path": _custom_reward_path,
    "reward.custom_reward_function.name": _custom_reward_name,
    "reward_model.n_gpus_per_node": lambda t, v: _rm_pool_devices(t, v, "reward_model.n_gpus_per_node"),
    "reward_model.enable_resource_pool": lambda t, v: _rm_pool_devices(t, v, "reward_model.enable_resource_pool")
    if v else None,
    "reward.reward_model.n_gpus_per_node": lambda t, v: _rm_pool_devices(t, v, "reward.reward_model.n_gpus_per_node"),
    "reward.reward_model.enable_resource_pool": lambda t, v: _rm_pool_devices(
        t, v, "reward.reward_model.enable_resource_pool") if v else None,
}


def _reason(key: str) -> str | None:
    if key in UNMAPPED:
        return UNMAPPED[key]
    best = max((p for p in UNMAPPED if p.endswith(".") and key.startswith(p)), key=len, default=None)
    return UNMAPPED[best] if best else None


def translate_overrides(overrides: list[str]) -> Translation:
    """verl's ``key=value`` overrides -> :class:`Translation` (later overrides win, as in Hydra)."""
    t = Translation()
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.lstrip("+~")
        if not sep:
            t.unmapped.append((key, "", "not a key=value override"))
            continue
        value = _value(raw)
        try:
            if key in KEYS:
                t.set(KEYS[key], _mrl_value(KEYS[key], value))
            elif key in CONVERTERS:
                CONVERTERS[key](t, value)
            else:
                why = _reason(key)
                t.unmapped.append((key, raw, why or "no mrl equivalent known (see docs/config.md for mrl's keys)"))
        except Unmappable as e:
            t.unmapped.append((key, raw, str(e)))
    _hybrid_engine(t)
    _finish(t)
    return t


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _value(raw: str) -> Any:
    v = parse_value(raw)
    if isinstance(v, str) and v.startswith("[") and v.endswith("]"):
        # Hydra's list form with unquoted paths containing ':' or '/' that YAML did not take
        v = [s.strip().strip("'\"") for s in v[1:-1].split(",") if s.strip()]
    if isinstance(v, str) and _NUMBER.fullmatch(v):
        v = float(v) if any(ch in v for ch in ".eE") else int(v)  # PyYAML reads 1e-6 as a string
    return v


_MEGATRON_LORA_NAMES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_q": ("q_proj",), "linear_k": ("k_proj",),
                        "linear_v": ("v_proj",), "linear_proj": ("o_proj",), "linear_fc1": ("gate_proj", "up_proj"),
                        "linear_fc1_gate": ("gate_proj",), "linear_fc1_up": ("up_proj",), "linear_fc2": ("down_proj",)}


def _mrl_value(key: str, v: Any) -> Any:
    if key in ("data.train_files", "data.val_files") and isinstance(v, str):
        return [v]
    if key == "actor.lora.target_modules":
        names = ([v] if v == "all-linear" or "," not in v else [s.strip() for s in v.split(",")]) if isinstance(v, str) else v
        # Megatron-Bridge's module names (verl's megatron LoRA) -> the Hugging Face projections mrl names
        return list(dict.fromkeys(h for n in names for h in _MEGATRON_LORA_NAMES.get(n, (n,))))
    return v


def _hybrid_engine(t: Translation) -> None:
    """verl colocates actor and rollout (the hybrid engine) and hands weights over in GPU memory."""
    if not t.config:
        return
    t.set("rollout.placement", "colocated")
    t.set("rollout.weight_sync.transport", "tensor")
    if t.get("rollout.engine") is None:
        t.set("rollout.engine", "sglang")  # verl's default engine is a GPU server too (vLLM)
    t.notes.append("verl's hybrid engine = rollout.placement=colocated with rollout.weight_sync.transport=tensor")


def _finish(t: Translation) -> None:
    """Rules where verl derives or ignores what mrl asks for explicitly."""
    rm = t.config.get("reward_model", {})
    if "max_length" in rm and not rm.get("model", {}).get("input_tokenizer"):
        t.unmapped.append(("reward_model.max_length", str(rm.pop("max_length")),
                           ("mrl's reward model reads the policy's own tokens unless reward_model.model.input_tokenizer "
                            "re-renders them; only then does a length bound apply")))
    if t.get("actor.use_dynamic_bsz") is not None and t.get("critic.use_dynamic_bsz") is None and t.config.get("critic"):
        t.set("critic.use_dynamic_bsz", t.get("actor.use_dynamic_bsz"))  # verl's critic default follows the actor's
    if t.config and t.get("cluster.device") is None and not any(k == "trainer.device" for k, _, _ in t.unmapped):
        # verl's trainer.device defaults to cuda; `auto` would make the plan depend on the host it runs on
        t.set("cluster.device", "cuda")
        t.notes.append("cluster.device=cuda: a verl launch is a GPU run (verl's trainer.device defaults to cuda), so "
                       "`mrl plan` plans it for GPUs on any host; to try it on a CPU host instead: cluster.device=cpu "
                       "rollout.engine=torch (and a small model)")
    nnodes = t.get("cluster.nnodes")
    if isinstance(nnodes, int) and nnodes > 1:
        t.set("rollout.host", "0.0.0.0")
        t.notes.append(f"cluster.nnodes={nnodes}: the engines listen on rollout.host=0.0.0.0 (reached by node IP with a "
                       "per-run token); colocated engines on several nodes need a weight sync other than tensor: "
                       "mrl plan names the options")


def translate(args: list[str], read_file: Callable[[str], str] | None = None) -> Translation:
    """``mrl from-verl`` input: one ``*.sh`` path (read with ``read_file``) or the overrides themselves."""
    if len(args) == 1 and args[0].endswith(".sh"):
        if read_file is None:
            raise ValueError("a script path needs read_file")
        overrides, notes = overrides_from_script(read_file(args[0]))
    else:
        overrides, notes = [a for a in args if "=" in a and not a.startswith("-")], []
    t = translate_overrides(overrides)
    t.notes[:0] = notes
    return t
