"""Cross-field checks run before anything expensive starts; every problem is collected.

``check_config(cfg) -> (errors, notes)``: each error names the keys involved and the fix; notes
are things the plan should say (skipped model checks, files not created yet). Model-dependent
checks read ``model.path/config.json`` with plain json and are skipped (with a note) when it
does not exist yet, e.g. for a HF hub id resolved on the GPU host.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
from pathlib import Path

from mrl.config.auto import _gpu_visible, _on_cuda, inprocess_blockers
from mrl.config.hf import ModelShape, read_model_shape
from mrl.config.layout import RoleLayout, compute_layout, num_engines, separate_devices
from mrl.config.parallel import ParallelConfig
from mrl.config.preflight import check_checkpoints
from mrl.config.root import MRLConfig
from mrl.config.run_plan import on_policy_blockers
from mrl.config.validate_agent import check_tool_prompt_room
from mrl.config.validate_async import check_async
from mrl.config.validate_attention import check_attention
from mrl.config.validate_engines import (
    check_engine_span,
    explain_actor_devices,
    separate_breakdown,
)
from mrl.config.validate_extensions import check_extension_points
from mrl.config.validate_hybrid import check_dsa, check_hybrid, lora_target_problem
from mrl.config.validate_judge import check_judge
from mrl.config.validate_moe import check_moe, family_plan_notes, family_refusals
from mrl.config.validate_parallel import (
    GROUP_KEYS,
    check_context_parallel,
    check_model_fits,
    check_parallel,
    check_separate_layout,
)
from mrl.config.validate_reward_model import check_reward_model
from mrl.config.validate_teacher import check_teacher
from mrl.config.validate_vision import check_vision_layout
from mrl.net import is_loopback

_GROUP_ESTIMATORS = {"grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk"}
_DATA_SUFFIXES = (".parquet", ".jsonl")


def _check_batches(cfg: MRLConfig, actor: RoleLayout, errors: list[str]) -> None:
    a, n, tbs = cfg.actor, cfg.rollout.n, cfg.data.train_batch_size
    if a.ppo_mini_batch_size > tbs:
        errors.append(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} exceeds data.train_batch_size={tbs} (both count prompts); "
            f"fix: set actor.ppo_mini_batch_size <= {tbs}"
        )
    elif tbs % a.ppo_mini_batch_size:
        errors.append(
            f"data.train_batch_size*rollout.n={tbs * n} samples is not divisible by actor.ppo_mini_batch_size*rollout.n="
            f"{a.ppo_mini_batch_size * n} (data.train_batch_size={tbs} % actor.ppo_mini_batch_size={a.ppo_mini_batch_size} != 0); "
            "fix: make data.train_batch_size a multiple of actor.ppo_mini_batch_size"
        )
    _check_role_batches("actor", a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                        a.ppo_max_token_len_per_gpu, cfg, actor, errors)


def _check_role_batches(role: str, mini: int, micro: int | None, dynamic: bool, max_tok: int,
                        cfg: MRLConfig, lay: RoleLayout, errors: list[str]) -> None:
    n = cfg.rollout.n
    samples = mini * n
    if lay.dp and samples % lay.dp:
        errors.append(
            f"{role} mini-batch of {samples} samples ({role}.ppo_mini_batch_size={mini} * rollout.n={n}) is not divisible by "
            f"the {role} DP size {lay.dp} ({lay.count} devices / TP*PP*CP={lay.parallel.model_parallel_size}); "
            f"fix: make {role}.ppo_mini_batch_size*rollout.n a multiple of {lay.dp} or change {role}.megatron"
        )
    per_rank = samples // lay.dp if lay.dp else 0
    pp, vpp = ((lay.parallel.pipeline_model_parallel_size, lay.parallel.virtual_pipeline_model_parallel_size)
               if lay.parallel is not None else (1, None))
    if vpp and per_rank and per_rank < pp:  # Megatron's interleaved schedule: at least PP micro-batches per call
        errors.append(
            f"{role}.megatron.virtual_pipeline_model_parallel_size={vpp} runs at least pipeline_model_parallel_size={pp} "
            f"micro-batches, of one sample or more, per mini-batch and DP rank, which gets {per_rank} sample(s) "
            f"({role}.ppo_mini_batch_size={mini} * rollout.n={n} / DP {lay.dp}); fix: raise {role}.ppo_mini_batch_size "
            f"to {-(-pp * lay.dp // n)} or more, or set {role}.megatron.virtual_pipeline_model_parallel_size=null"
        )
    if dynamic:
        seq = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        cp = lay.parallel.context_parallel_size if lay.parallel is not None else 1  # a row spreads over CP devices
        if max_tok * cp < seq:
            need = -(-seq // cp)
            errors.append(
                f"{role}.ppo_max_token_len_per_gpu={max_tok} is below one full sequence (data.max_prompt_length + "
                f"rollout.max_response_length = {seq}" + (f", over CP={cp} devices" if cp > 1 else "")
                + f"); fix: set {role}.ppo_max_token_len_per_gpu >= {need}"
            )
    elif micro is None:
        errors.append(
            f"{role}.ppo_micro_batch_size_per_gpu is not set; fix: set it (samples per forward/backward per DP rank, "
            f"e.g. {role}.ppo_micro_batch_size_per_gpu=4) or set {role}.use_dynamic_bsz=true"
        )
    elif per_rank and per_rank % micro:
        errors.append(
            f"{role}.ppo_micro_batch_size_per_gpu={micro} does not divide the {per_rank} samples each DP rank gets per "
            f"mini-batch; fix: choose a divisor of {per_rank}"
        )


def _check_placement(cfg: MRLConfig, roles: dict[str, RoleLayout], shape: ModelShape | None, errors: list[str]) -> None:
    world = cfg.cluster.world_size
    sep = separate_devices(cfg)
    for role, section in (("ref", cfg.ref), ("critic", cfg.critic), ("reward_model", cfg.reward_model)):
        if role in roles and section.placement == "separate" and not section.num_devices:
            errors.append(f"{role}.placement=separate needs {role}.num_devices; fix: set {role}.num_devices=<devices for the {role}>")
        if section.placement == "colocated" and section.num_devices is not None:
            errors.append(f"{role}.num_devices is only used with {role}.placement=separate; fix: remove it or set {role}.placement=separate")
    if cfg.ref_enabled and cfg.ref.placement == "colocated":
        differ = [k for k in GROUP_KEYS if getattr(cfg.ref.megatron, k) not in (getattr(ParallelConfig(), k),
                                                                                 getattr(cfg.actor.megatron, k))]
        if differ:
            k = differ[0]
            errors.append(f"ref.megatron.{k}={getattr(cfg.ref.megatron, k)} differs from actor.megatron.{k}="
                          f"{getattr(cfg.actor.megatron, k)}, but a colocated reference runs in the actor's model chunks "
                          "with the actor's layout; fix: remove ref.megatron (or set it equal to actor.megatron), or "
                          "ref.placement=separate with ref.num_devices")
    if cfg.ref.offload and cfg.ref.placement == "separate":
        # The colocated reference already lives in host memory between passes; a separate one
        # has no offload path yet, and a flag that silently does nothing is worse than an error.
        errors.append("ref.offload=true is not supported with ref.placement=separate; fix: ref.offload=false, "
                      "or ref.placement=colocated (which keeps reference weights in host memory between passes)")
    if cfg.repr_align_enabled and cfg.ref.placement == "separate":
        # repr_align embeds responses under the reference weights swapped into the actor's chunks
        # (ColocatedReference.compute_repr_similarity); the separate reference computes log-probs only.
        errors.append("algorithm.repr_align.enable=true reads the reference's hidden states, which only a colocated "
                      "reference provides; fix: ref.placement=colocated (or algorithm.repr_align.enable=false)")
    r = cfg.rollout
    if r.placement == "separate" and r.num_engines is None:
        errors.append("rollout.placement=separate needs rollout.num_engines; fix: set rollout.num_engines=<servers>")
    actor_n = roles["actor"].count
    if actor_n <= 0:
        errors.append(
            f"separate roles take {sum(sep.values())} devices ({separate_breakdown(cfg)}) of the "
            f"{world} available (cluster.nnodes*cluster.n_gpus_per_node), leaving none for the actor; "
            "fix: add devices or use placement=colocated"
        )
        return
    if r.placement == "colocated":
        if actor_n % r.engine_tp_size:
            errors.append(
                f"rollout.engine_tp_size={r.engine_tp_size} does not divide the {actor_n} engine devices (colocated with the "
                f"actor); fix: choose rollout.engine_tp_size dividing {actor_n}"
            )
        elif num_engines(cfg, actor_n) * r.engine_tp_size > actor_n:
            errors.append(
                f"rollout.num_engines*rollout.engine_tp_size = {num_engines(cfg, actor_n) * r.engine_tp_size} exceeds the "
                f"{actor_n} actor devices the colocated engines share; fix: rollout.num_engines={actor_n // r.engine_tp_size} or null"
            )
        if r.weight_sync.transport == "disk":
            pass  # valid everywhere, only slower
        c = cfg.cluster
        cuda = _on_cuda(cfg)
        if cuda and r.weight_sync.transport == "distributed":
            # Seen on an H100 (docs/cuda_check.md): a second NCCL rank on a GPU already in the group fails
            # with "Duplicate GPU detected"; colocated engines sit on the trainer ranks' GPUs.
            errors.append(
                "rollout.weight_sync.transport=distributed with rollout.placement=colocated on CUDA puts each engine into "
                "one NCCL group with the trainer rank on its own GPU, which NCCL refuses (two ranks of one communicator "
                "on one device); fix: " + ("rollout.weight_sync.transport=tensor (CUDA IPC, the colocated path verl and "
                                          "slime use)" if c.nnodes == 1 else
                                          "rollout.placement=separate with rollout.num_engines (engines on GPUs of their own)")
            )
        if cuda and r.weight_sync.transport == "tensor" and c.nnodes > 1:
            errors.append(
                f"rollout.weight_sync.transport=tensor sends CUDA IPC handles from one rank per pipeline stage, which "
                f"engines on other nodes cannot open (cluster.nnodes={c.nnodes}); fix: rollout.placement=separate with "
                "rollout.num_engines and transport=distributed, or transport=disk on a shared filesystem"
            )
    elif r.weight_sync.transport == "tensor":
        errors.append(
            "rollout.weight_sync.transport=tensor passes in-process tensors and needs rollout.placement=colocated; "
            "fix: use transport=distributed (or disk) for separate engines"
        )
    if shape is not None and shape.num_heads % r.engine_tp_size:
        errors.append(
            f"rollout.engine_tp_size={r.engine_tp_size} does not divide the model's {shape.num_heads} attention heads; "
            f"fix: choose a divisor of {shape.num_heads}"
        )


def _check_lora(cfg: MRLConfig, shape: ModelShape | None, errors: list[str]) -> None:
    """actor.lora: no setting silently ignored, only what the adapters support (docs/lora.md)."""
    lo = cfg.actor.lora
    if not lo.enabled:
        stray = sorted(lo.model_fields_set - {"rank"})
        if stray:
            errors.append(f"actor.lora.{stray[0]} is set but actor.lora.rank=0 (LoRA off) ignores it; fix: set "
                          "actor.lora.rank > 0 (e.g. 8) or remove " + ", ".join(f"actor.lora.{k}" for k in stray))
        return
    if not lo.target_modules:
        errors.append("actor.lora.target_modules is empty; fix: list HF projections (q_proj,k_proj,v_proj,o_proj,"
                      "gate_proj,up_proj,down_proj) or [all-linear]")
    elif "all-linear" in lo.target_modules and len(lo.target_modules) > 1:
        errors.append(f"actor.lora.target_modules={lo.target_modules} mixes all-linear with projection names; fix: "
                      "use [all-linear] alone or list the projections")
    if cfg.ref.placement == "separate" and not lo.separate_reference:
        errors.append("ref.placement=separate with actor.lora.rank > 0 would hold a second full model although the "
                      "actor with its adapters off is the reference; fix: ref.placement=colocated (no copy), or "
                      "actor.lora.separate_reference=true to keep a separate reference anyway")
    if lo.separate_reference and cfg.ref.placement != "separate":
        errors.append("actor.lora.separate_reference=true is only used with ref.placement=separate; fix: remove it")
    target_problem = lora_target_problem(cfg, shape)
    if target_problem:
        errors.append(target_problem)
    if cfg.actor.megatron.sequence_parallel:
        errors.append("actor.megatron.sequence_parallel=true is not supported with actor.lora (LoRA builds Megatron's "
                      "local layer spec, whose torch norms refuse sequence parallelism); fix: "
                      "actor.megatron.sequence_parallel=false")
    if shape is not None and lo.rank > shape.hidden_size:  # MoE models: config/validate_moe.py
        errors.append(f"actor.lora.rank={lo.rank} exceeds the model's hidden size {shape.hidden_size} (no longer "
                      f"low-rank); fix: choose actor.lora.rank <= {shape.hidden_size}, typically 8-64")


# verl aggregates these per sequence whatever loss_agg_mode says; mrl refuses the other modes instead.
_SEQ_MEAN_LOSSES = {"sapo": "SAPO's gate is averaged per sequence", "geo_mean": "GMPO is a per-sequence objective"}


def _check_losses(cfg: MRLConfig, errors: list[str]) -> None:
    a, rc = cfg.actor, cfg.algorithm.rollout_correction
    why = _SEQ_MEAN_LOSSES.get(a.policy_loss)
    if why and a.loss_agg_mode != "seq-mean-token-mean":
        errors.append(f"actor.policy_loss={a.policy_loss} with actor.loss_agg_mode={a.loss_agg_mode}: {why} (verl "
                      "always uses seq-mean-token-mean for it); fix: actor.loss_agg_mode=seq-mean-token-mean")
    if a.tis_imp_ratio_cap is not None and rc.rollout_is is not None:
        errors.append(f"actor.tis_imp_ratio_cap and algorithm.rollout_correction.rollout_is are both set: the weights "
                      f"would be applied twice; fix: keep one (tis_imp_ratio_cap={a.tis_imp_ratio_cap} is "
                      f"rollout_is=token, rollout_is_threshold={a.tis_imp_ratio_cap})")


def _check_algorithm(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    a, al = cfg.actor, cfg.algorithm
    for key, val in (("actor.kl_loss_type", a.kl_loss_type), ("algorithm.kl_penalty", al.kl_penalty)):
        if val == "full":
            errors.append(
                f"{key}=full (exact KL over the whole vocabulary) is not supported: it needs the reference's full [B, T, V] "
                f"logits; fix: use {key}=low_var_kl (k3) or kl (k1)"
            )
    needs = [k for k, on in (("actor.use_kl_loss", a.use_kl_loss), ("algorithm.use_kl_in_reward", al.use_kl_in_reward),
                             ("algorithm.ref_reward_blend.enable", al.ref_reward_blend.enable),
                             ("algorithm.repr_align.enable", cfg.repr_align_enabled)) if on]
    if cfg.ref.enable is False and needs:
        errors.append(f"{', '.join(needs)} need the reference (ref_log_prob or its weights) but ref.enable=false; "
                      "fix: set ref.enable=true (or null) or turn that off")
    if a.use_kl_loss and al.use_kl_in_reward and not al.allow_double_kl:
        errors.append(
            "actor.use_kl_loss=true and algorithm.use_kl_in_reward=true apply the KL penalty twice; fix: turn one off, "
            "or set algorithm.allow_double_kl=true if that is intended"
        )
    if al.adv_estimator in _GROUP_ESTIMATORS and cfg.rollout.n < 2:
        errors.append(
            f"algorithm.adv_estimator={al.adv_estimator} compares responses within a prompt group but rollout.n="
            f"{cfg.rollout.n}; fix: set rollout.n >= 2 (e.g. 8)"
        )
    _check_losses(cfg, errors)
    if al.adv_estimator == "gae" and not cfg.critic_enabled:
        errors.append("algorithm.adv_estimator=gae needs values but critic.enable=false; fix: set critic.enable=true (or null)")
    if cfg.critic_enabled and al.adv_estimator != "gae":
        notes.append(f"critic.enable=true but algorithm.adv_estimator={al.adv_estimator} does not use values")
    if cfg.trainer.critic_warmup and not cfg.critic_enabled:
        errors.append("trainer.critic_warmup > 0 but no critic is built; fix: set trainer.critic_warmup=0 or enable the critic")
    if al.kl_ctrl.type == "adaptive" and not al.use_kl_in_reward:
        notes.append("algorithm.kl_ctrl.type=adaptive has no effect unless algorithm.use_kl_in_reward=true")
    if a.on_policy_shortcut and (blockers := on_policy_blockers(cfg)):
        errors.append(f"actor.on_policy_shortcut=true but the update is not on-policy: {'; '.join(blockers)}; fix: "
                      "set actor.on_policy_shortcut=null (recompute log pi_old where needed) or change those settings")
    for role, o in (("actor", a.optim), ("critic", cfg.critic.optim)):
        if o.lr_warmup_steps and o.lr_warmup_steps_ratio:
            errors.append(
                f"{role}.optim.lr_warmup_steps and {role}.optim.lr_warmup_steps_ratio are both set; fix: set only one of them"
            )


def _check_rollout(cfg: MRLConfig, shape: ModelShape | None, errors: list[str]) -> None:
    r = cfg.rollout
    if r.temperature <= 0:
        errors.append(f"rollout.temperature={r.temperature} must be > 0 for sampling; fix: e.g. rollout.temperature=1.0")
    if r.top_k == 0:
        errors.append("rollout.top_k=0 keeps no token; fix: rollout.top_k=-1 (disabled) or a value >= 1")
    _check_val_kwargs(cfg, errors)
    if r.engine == "sglang":
        if cfg.cluster.device == "cpu":
            errors.append("rollout.engine=sglang needs CUDA devices but cluster.device=cpu; fix: rollout.engine=torch or cluster.device=cuda")
        elif cfg.cluster.device == "auto" and cfg.cluster.address is None and not _gpu_visible():
            errors.append(
                "rollout.engine=sglang needs CUDA devices but this host shows no NVIDIA GPU (cluster.device=auto, local Ray); "
                "fix: rollout.engine=torch, or run on a GPU host"
            )
        if r.weight_sync.verify:
            errors.append("rollout.weight_sync.verify=true reads the engines' /weights_checksum, which only the embedded "
                          "engine has (SGLang's /weights_checker checksums its own sharded parameters); fix: "
                          "rollout.weight_sync.verify=false with rollout.engine=sglang")
    if r.router == "sglang_router" and importlib.util.find_spec("sglang_router") is None:
        errors.append("rollout.router=sglang_router needs the sglang_router package on the driver's host; "
                      "fix: pip install sglang-router, or rollout.router=builtin")
    if cfg.cluster.nnodes > 1 and is_loopback(r.host):
        errors.append(f"rollout.host={r.host} with cluster.nnodes={cfg.cluster.nnodes}: engines on other nodes would be "
                      "unreachable from the driver; fix: rollout.host=0.0.0.0 (mrl then gives every engine a per-run token)")
    seq = cfg.data.max_prompt_length + r.max_response_length
    if shape is not None and shape.max_positions and seq > shape.max_positions:
        errors.append(
            f"data.max_prompt_length + rollout.max_response_length = {cfg.data.max_prompt_length} + {r.max_response_length} "
            f"= {seq} exceeds the model's max_position_embeddings={shape.max_positions} ({cfg.model.path}/config.json); "
            "fix: shorten one of them"
        )


def _check_inprocess_engines(cfg: MRLConfig, errors: list[str]) -> None:
    """transport=inprocess: each trainer rank hosts engine r (mrl/rollout/engine/in_process.py), which needs a
    CPU run, the built-in engine, colocated one-rank engines and ranks that each hold the whole model."""
    c = cfg.cluster
    if cfg.rollout.weight_sync.transport != "inprocess":
        return
    why = []
    if c.device == "cuda" or (c.device == "auto" and cfg.cluster.address is None and _gpu_visible()):
        why.append(f"cluster.device={c.device} (CPU only: on GPUs the engine wants its own memory and SGLang)")
    why += inprocess_blockers(cfg)
    if why:
        errors.append("rollout.weight_sync.transport=inprocess does not fit " + "; ".join(why)
                      + "; fix: rollout.weight_sync.transport=tensor")


def _check_val_kwargs(cfg: MRLConfig, errors: list[str]) -> None:
    v = cfg.rollout.val_kwargs
    if v.do_sample:
        # verl asserts the same (on the rollout temperature; the validation one is what samples).
        if v.temperature <= 0:
            errors.append(f"rollout.val_kwargs.do_sample=true needs rollout.val_kwargs.temperature > 0 (got {v.temperature}); "
                          "fix: e.g. rollout.val_kwargs.temperature=1.0, or do_sample=false for greedy answers")
        if v.top_k == 0:
            errors.append("rollout.val_kwargs.top_k=0 keeps no token; fix: rollout.val_kwargs.top_k=-1 (disabled) or >= 1")
        return
    if v.n > 1:
        errors.append(f"rollout.val_kwargs.n={v.n} with rollout.val_kwargs.do_sample=false would generate {v.n} identical "
                      "greedy answers per prompt; fix: rollout.val_kwargs.do_sample=true with temperature > 0, or n=1")
    # verl's agent loop samples with these even when do_sample=false while its HF rollout ignores
    # them; a set value we would ignore is refused rather than silently dropped.
    ignored = [f"{k}={getattr(v, k)}" for k, d in (("temperature", 0.0), ("top_p", 1.0), ("top_k", -1)) if getattr(v, k) != d]
    if ignored:
        errors.append(f"rollout.val_kwargs.{', '.join(ignored)} would be ignored: rollout.val_kwargs.do_sample=false decodes "
                      "greedily; fix: rollout.val_kwargs.do_sample=true to sample with them, or remove them")


def _check_dapo(cfg: MRLConfig, errors: list[str]) -> None:
    """algorithm.filter_groups (dynamic sampling), data.gen_batch_size, reward.overlong_buffer."""
    fg, r = cfg.algorithm.filter_groups, cfg.rollout
    if fg.enable:
        if fg.metric is None:
            errors.append("algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric; "
                          "fix: acc (scorer returns 'acc'), score, seq_reward or seq_final_reward")
        if r.n < 2:
            errors.append(f"algorithm.filter_groups needs groups: rollout.n={r.n} keeps every prompt; fix: rollout.n >= 2")
        if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
            errors.append("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the KL "
                          "penalty needs reference log-probs, computed only for the kept groups; fix: metric=seq_reward")
    elif cfg.data.gen_batch_size is not None:
        errors.append(f"data.gen_batch_size={cfg.data.gen_batch_size} is only used with algorithm.filter_groups.enable=true; "
                      "fix: remove it or enable filter_groups")
    ob = cfg.reward.overlong_buffer
    if ob.enable and not 0 < ob.len < r.max_response_length:
        errors.append(f"reward.overlong_buffer.len={ob.len} must be in (0, rollout.max_response_length={r.max_response_length}); "
                      f"fix: e.g. reward.overlong_buffer.len={max(1, r.max_response_length // 4)}")


def _check_files(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for i, f in enumerate(files):
            if not f.endswith(_DATA_SUFFIXES):
                errors.append(f"{key}[{i}]={f!r} is neither .parquet nor .jsonl; fix: convert it or point {key} at such a file")
            elif not Path(f).exists():
                notes.append(f"{key}[{i}]={f!r} does not exist yet; the run needs it")
    if not cfg.data.train_files:
        errors.append("data.train_files is empty; fix: data.train_files=[path/to/train.parquet]")
    t = cfg.trainer
    if t.test_freq > 0 and not cfg.data.val_files:
        errors.append(f"trainer.test_freq={t.test_freq} but data.val_files is empty; fix: set data.val_files or trainer.test_freq=-1")
    if t.val_before_train and not cfg.data.val_files:
        errors.append("trainer.val_before_train=true but data.val_files is empty; fix: set data.val_files or val_before_train=false")
    if t.save_freq > 0 and not t.default_local_dir:
        errors.append(f"trainer.save_freq={t.save_freq} but trainer.default_local_dir is empty; fix: set trainer.default_local_dir=checkpoints/<run>")
    if t.resume_mode not in ("auto", "disable") and not Path(t.resume_mode).exists():
        errors.append(f"trainer.resume_mode={t.resume_mode!r} is neither auto, disable nor an existing checkpoint path; fix: one of those")


def _check_checkpoint_and_val_only(cfg: MRLConfig, errors: list[str]) -> None:
    ck, t = cfg.actor.checkpoint, cfg.trainer
    for key, contents in (("save_contents", ck.save_contents), ("load_contents", ck.load)):
        if "model" not in contents:
            errors.append(
                f"actor.checkpoint.{key}={contents} lacks 'model': an mrl checkpoint always carries the Megatron weights "
                f"a resume starts from; fix: actor.checkpoint.{key}=[{','.join(['model', *contents])}]")
    if t.val_only and not t.val_before_train:
        errors.append("trainer.val_only=true runs in the val_before_train slot (verl trains anyway without it); "
                      "fix: also set trainer.val_before_train=true")


def _check_reliability(cfg: MRLConfig, errors: list[str], notes: list[str]) -> None:
    """Settings that would otherwise fail (or hang) only once Ray and Megatron are up."""
    fn = cfg.reward.function
    if ":" not in fn:
        # the registry is plain Python (no heavy imports): mrl plan stays fast
        from mrl.rewards.registry import reward_names

        if fn not in reward_names():
            errors.append(f"reward.function={fn!r} is not a registered scorer (valid: {', '.join(reward_names())}); "
                          "fix: one of those, 'pkg.module:fn' or 'path/to/file.py:fn'")
    # An LR schedule (or warmup ratio) with total_epochs needs no total_training_steps: the run plan takes
    # the length from the loaded training set (RunPlan.total_steps), as verl takes it from its dataloader.
    _check_host_capacity(cfg, errors)


def _visible_gpus() -> int | None:
    """GPUs this host exposes (honouring CUDA_VISIBLE_DEVICES); None when unknown."""
    nodes = glob.glob("/dev/nvidia[0-9]*")
    if not nodes:
        return None
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is None:
        return len(nodes)
    return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])


def _check_host_capacity(cfg: MRLConfig, errors: list[str]) -> None:
    """A local single-node run cannot place more ranks than this host has devices (Ray would wait
    for the placement group until its timeout)."""
    c = cfg.cluster
    if c.cpus_per_node is not None and c.cpus_per_node < c.n_gpus_per_node:
        errors.append(f"cluster.cpus_per_node={c.cpus_per_node} is less than the {c.n_gpus_per_node} ranks per node "
                      "(each rank takes one CPU); fix: raise cluster.cpus_per_node or lower cluster.n_gpus_per_node")
    if c.address is not None or c.nnodes != 1:
        return  # other hosts' inventory is not visible from here
    if c.device == "cuda":
        gpus = _visible_gpus()
        if gpus is not None and c.n_gpus_per_node > gpus:
            errors.append(f"cluster.n_gpus_per_node={c.n_gpus_per_node} but this host exposes {gpus} GPU(s); "
                          f"fix: cluster.n_gpus_per_node<={gpus} (or join a cluster with cluster.address)")
    # CPU ranks beyond the core count share cores (slow, correct): the driver gives Ray enough CPUs.


def _vision_language(path: str) -> bool:
    from mrl.config.checkpoint_files import untrainable_vision_language

    try:
        return untrainable_vision_language(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


def load_shape(cfg: MRLConfig, errors: list[str], notes: list[str]) -> ModelShape | None:
    """Model shape from model.path/config.json, or None with a note (absent) or an error (unreadable)."""
    if not cfg.model.path:
        errors.append("model.path is not set; fix: model.path=<HF checkpoint directory or hub id resolved on the GPU host>")
        return None
    try:
        shape = read_model_shape(cfg.model.path)
    except ValueError as e:
        if not _vision_language(cfg.model.path):  # its one error is checkpoint_files' VISION_REFUSAL
            errors.append(f"model.path: {e}")
        return None
    if shape is None:
        from mrl.config.hf import bundled_hub_shape

        shape = bundled_hub_shape(cfg.model.path)
        if shape is not None:
            notes.append(f"model.path={cfg.model.path!r} is not on this host: model checks and the memory estimate use "
                         "mrl's copy of its config.json (mrl/config/hub_shapes/); the GPU host must hold the model")
            return shape
    if shape is None and not Path(cfg.model.path).exists():  # an existing non-model path: preflight's error
        notes.append(
            f"model.path={cfg.model.path!r} has no config.json here (yet); model checks (heads/TP, layers/PP, "
            "positions) and the memory estimate are skipped"
        )
    return shape




def _check_critic_shares_the_actor(cfg: MRLConfig, errors: list[str]) -> None:
    """The critic runs on the actor's ranks and reuses its Megatron groups (there is one
    ``parallel_state`` per process), so it is colocated and its group-defining sizes equal the actor's."""
    c = cfg.critic
    if c.placement != "colocated":
        errors.append("critic.placement=separate is not supported (the critic runs on the actor's ranks); "
                      "fix: critic.placement=colocated and unset critic.num_devices")
    diff = [k for k in GROUP_KEYS if getattr(c.megatron, k) != getattr(cfg.actor.megatron, k)]
    if diff:
        errors.append("critic.megatron layout differs from actor.megatron in " + ", ".join(
            f"critic.megatron.{k}={getattr(c.megatron, k)} (actor {getattr(cfg.actor.megatron, k)})" for k in diff)
            + ": the colocated critic shares the actor's parallel groups; fix: set critic.megatron.<key> equal to actor.megatron.<key>")


def _check_reward_model_layout(cfg: MRLConfig, roles: dict[str, RoleLayout], actor_shape: ModelShape | None,
                               errors: list[str]) -> None:
    """A separate RM's layout (reward_model.megatron, or the actor's sizes when null) on its own devices; either
    placement's TP/PP against the RM's own config.json (its heads and layers, not the actor's)."""
    lay = roles.get("reward_model")
    rm = cfg.reward_model
    if lay is None or not rm.model.path:
        return
    separate = rm.placement == "separate"
    key = "reward_model.megatron" if separate else "actor.megatron"
    if separate:
        check_separate_layout("reward_model", "reward model", rm.megatron, lay, cfg, errors)
    try:
        shape = read_model_shape(rm.model.path)
    except ValueError:
        return  # check_reward_model names the unreadable config.json
    if shape is not None and (separate or shape != actor_shape):  # an equal shape: the actor's check said it
        # a colocated RM runs at the actor's layout: the key to change is actor.megatron's (or go separate)
        check_model_fits(key, lay.parallel, shape, f"the reward model's {rm.model.path}/config.json", errors)


def missing_inputs(cfg: MRLConfig) -> list[str]:
    """The files a run reads that are not on this host (``mrl plan`` notes them: the plan may be made
    before the model is downloaded; ``mrl train`` refuses to start without them)."""
    critic = [("critic.model_path", cfg.critic.model_path)] if cfg.critic_enabled and cfg.critic.model_path else []
    j = cfg.reward.judge
    critic += [("reward.judge.model", j.model)] if j.enable and j.model else []  # docs/judge.md
    return [f"{key}={path!r} does not exist; for the quickstart run `python -m mrl.quickstarts "
            f"{'judge' if key == 'reward.judge.model' else 'base'} --out outputs/quickstart` first (make train does)"
            for key, path in (("model.path", cfg.model.path), *critic, *(("data.train_files", f) for f in cfg.data.train_files))
            if path and not Path(path).exists()]


def _check_agent_sandbox(cfg: MRLConfig, errors: list[str]) -> None:
    """The python tool's code never runs outside its sandbox: a host that cannot build one is refused now."""
    if "python" not in cfg.agent.tools:
        return
    from mrl.agent.builtin_tools import sandbox_problem

    if (why := sandbox_problem()) is not None:
        errors.append(f"agent.tools: the python tool's sandbox cannot be built on this host ({why}); fix: allow user "
                      "namespaces (sysctl user.max_user_namespaces=10000, and kernel.unprivileged_userns_clone=1 where it "
                      "exists, or a container that permits them), or remove python from agent.tools (docs/agent.md)")


def _check_agent(cfg: MRLConfig, errors: list[str]) -> None:
    """agent.enable: every tool loads with a schema (plugins imported here, as the other extension
    points), the tool workers can take their memory limit (the hard RLIMIT_AS of this process, which the
    driver's tool workers inherit); the rollout modes the agent loop does not drive are refused (docs/agent.md)."""
    a = cfg.agent
    if not a.enable:
        stray = sorted(a.model_fields_set - {"enable"})  # as actor.lora / teacher.*: no setting silently ignored
        if stray:
            errors.append(f"agent.{stray[0]} is set but agent.enable=false (only agent rollouts read agent.*); fix: "
                          "agent.enable=true, or remove " + ", ".join(f"agent.{k}" for k in stray))
        return
    from mrl.plugin_checks import tool_schemas
    from mrl.plugins import check_in_child, is_spec

    plugins = [spec for spec in a.tools if is_spec(spec)]
    try:  # the tools' schemas, built where their plugins are imported: the check's child (one import of each)
        schemas = (check_in_child("mrl.plugin_checks:tool_schemas", [a.tools], "agent.tools", plugins)
                   if plugins else tool_schemas(a.tools))
    except ValueError as e:
        errors.append(str(e))
    else:
        check_tool_prompt_room(cfg, schemas, errors)
    _check_agent_sandbox(cfg, errors)
    from mrl.agent.worker import memory_limit_problem

    if (why := memory_limit_problem(a.tool_memory_mb)) is not None:  # every tool worker would die at its setrlimit
        errors.append(f"agent.tool_memory_mb={a.tool_memory_mb}: a tool worker cannot set this memory limit (RLIMIT_AS): "
                      f"{why}; fix: a smaller agent.tool_memory_mb, or a higher hard limit for mrl (ulimit -Hv, as root)")
    if cfg.trainer.async_training.max_staleness > 0 or cfg.rollout.partial_rollout:
        errors.append("agent.enable with trainer.async_training.max_staleness > 0 / rollout.partial_rollout: the agent "
                      "loop runs on-policy only (its multi-turn trajectories are not continued across weight pushes); "
                      "fix: set max_staleness=0 and rollout.partial_rollout=false, or agent.enable=false")


def check_config(cfg: MRLConfig) -> tuple[list[str], list[str]]:
    """All cross-field errors and plan notes of ``cfg``; nothing is started or imported beyond json."""
    errors: list[str] = []
    notes: list[str] = []
    shape = load_shape(cfg, errors, notes)
    roles = compute_layout(cfg)
    _check_placement(cfg, roles, shape, errors)
    check_engine_span(cfg, roles, errors, notes)  # an engine wider than a node (SGLang over whole nodes)
    for role in ("actor", "ref", "critic"):
        if role in roles and roles[role].count > 0:
            check_parallel(role, roles[role].parallel, roles[role], cfg, shape, errors)
    check_context_parallel(cfg, shape, "cuda" if _on_cuda(cfg) else "cpu", errors)
    check_vision_layout(cfg, errors)  # a vision-language model: SP, CP, shared prefix, Qwen3-VL's deepstack stage
    _check_reward_model_layout(cfg, roles, shape, errors)
    check_moe(cfg, roles, shape, errors, notes)
    family_plan_notes(cfg.model.path, notes)
    family_refusals(cfg.model.path, errors)
    check_teacher(cfg, roles, shape, errors, notes)
    if roles["actor"].count > 0:
        _check_batches(cfg, roles["actor"], errors)
    if "critic" in roles and roles["critic"].count > 0:
        c = cfg.critic
        _check_role_batches("critic", c.ppo_mini_batch_size or cfg.actor.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu,
                            c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu, cfg, roles["critic"], errors)
    if cfg.critic_enabled:
        _check_critic_shares_the_actor(cfg, errors)
    _check_lora(cfg, shape, errors)
    check_attention(cfg, _on_cuda(cfg), errors)
    check_hybrid(cfg, _on_cuda(cfg), errors, notes)
    check_dsa(cfg, errors)
    _check_algorithm(cfg, errors, notes)
    _check_rollout(cfg, shape, errors)
    _check_inprocess_engines(cfg, errors)
    _check_dapo(cfg, errors)
    check_async(cfg, errors, notes)
    _check_files(cfg, errors, notes)
    _check_checkpoint_and_val_only(cfg, errors)
    _check_reliability(cfg, errors, notes)
    check_extension_points(cfg, errors)
    check_reward_model(cfg, errors, notes)
    check_judge(cfg, errors, notes)
    _check_agent(cfg, errors)
    check_checkpoints(cfg, errors, notes)
    if cfg.cluster.device == "cpu" and cfg.model.dtype in ("bfloat16", "float16"):
        # bfloat16 GEMMs outrun float32 on CPUs with AMX; without AMX / AVX512-BF16 bfloat16 is slower than
        # float32 (docs/performance.md, 'bfloat16 on CPU').
        notes.append(f"cluster.device=cpu with model.dtype={cfg.model.dtype}: fast only on CPUs with AMX or "
                     "AVX512-BF16 (bfloat16) and slow elsewhere; trainer and engine log-probs then agree at that "
                     "precision, not to 1e-6 as in float32")
    explain_actor_devices(cfg, roles, errors)  # name the keys (rollout.engine_tp_size) that shrank the actor
    return errors, notes
