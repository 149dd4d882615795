"""Table of bad configs: each must fail with an error line that names the offending key(s).

The base (``base_overrides`` in conftest.py) is valid and uses a real tiny HF checkpoint, so the
model-dependent checks (heads/TP, layers/PP, positions) run against its config.json.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.config import ConfigError, check_config, load_config

_PLUGIN = Path(__file__).resolve().parents[1] / "plugins" / "difficulty_plugin.py"

_RM = ["reward_model.enable=true", "reward_model.model.path=/nonexistent/rm"]  # no config.json: layout rules only
_RM_SEP = [*_RM, "reward_model.placement=separate"]

# (case id, overrides added to the valid base, substrings that ONE error line must all contain)
BAD = [
    # the critic shares the actor's ranks and Megatron groups (was refused only when the driver built)
    ("critic_layout_differs", ["critic.enable=true", "critic.ppo_micro_batch_size_per_gpu=4",
                               "critic.megatron.pipeline_model_parallel_size=2"],
     ["critic.megatron.pipeline_model_parallel_size=2 (actor 1)", "set critic.megatron.<key> equal to actor.megatron.<key>"]),
    ("critic_separate", ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4", "critic.placement=separate",
                         "critic.num_devices=2", "cluster.n_gpus_per_node=4"],
     ["critic.placement=separate", "fix: critic.placement=colocated"]),
    ("filter_groups_without_metric", ["algorithm.filter_groups.enable=true", "rollout.n=4"],
     ["algorithm.filter_groups.metric", "fix: acc"]),
    ("filter_groups_without_groups", ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "rollout.n=1"],
     ["rollout.n=1", "rollout.n >= 2"]),
    ("filter_groups_final_reward_with_kl_in_reward", [
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward", "rollout.n=4",
        "algorithm.use_kl_in_reward=true"], ["seq_final_reward", "metric=seq_reward"]),
    ("gen_batch_size_without_filter_groups", ["data.gen_batch_size=16"], ["data.gen_batch_size=16", "filter_groups"]),
    ("overlong_buffer_longer_than_response", ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4096"],
     ["reward.overlong_buffer.len=4096", "rollout.max_response_length"]),
    ("tbs_not_multiple_of_mini", ["data.train_batch_size=6"], ["data.train_batch_size", "actor.ppo_mini_batch_size"]),
    ("mini_larger_than_tbs", ["actor.ppo_mini_batch_size=16"], ["actor.ppo_mini_batch_size", "exceeds"]),
    ("mini_not_divisible_by_dp", ["cluster.n_gpus_per_node=3", "actor.ppo_micro_batch_size_per_gpu=1"],
     ["actor.ppo_mini_batch_size", "DP size 3"]),
    ("micro_not_dividing_rank_share", ["actor.ppo_micro_batch_size_per_gpu=3"], ["actor.ppo_micro_batch_size_per_gpu=3", "4 samples"]),
    ("micro_missing", ["actor.ppo_micro_batch_size_per_gpu=null"], ["actor.ppo_micro_batch_size_per_gpu", "use_dynamic_bsz"]),
    ("dynamic_budget_below_one_sequence", ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=64"],
     ["actor.ppo_max_token_len_per_gpu=64", "96"]),
    ("tp_pp_not_dividing_devices", ["actor.megatron.pipeline_model_parallel_size=4", "actor.megatron.tensor_model_parallel_size=2"],
     ["actor.megatron", "TP*PP*CP", "does not divide the 4 devices"]),
    ("heads_not_divisible_by_tp", ["cluster.n_gpus_per_node=3", "actor.megatron.tensor_model_parallel_size=3",
                                   "actor.ppo_micro_batch_size_per_gpu=1"],
     ["actor.megatron.tensor_model_parallel_size=3", "4 attention heads"]),
    ("kv_heads_not_divisible_by_tp", ["actor.megatron.tensor_model_parallel_size=4"],
     ["actor.megatron.tensor_model_parallel_size=4", "2 KV heads"]),
    ("layers_not_divisible_by_pp", ["cluster.n_gpus_per_node=3", "actor.megatron.pipeline_model_parallel_size=3",
                                    "actor.ppo_micro_batch_size_per_gpu=1"], ["actor.megatron", "4 layers", "= 3"]),
    ("layers_not_divisible_by_pp_vpp", ["actor.megatron.pipeline_model_parallel_size=2",
                                        "actor.megatron.virtual_pipeline_model_parallel_size=4"],
     ["virtual_pipeline_model_parallel_size", "= 8"]),
    ("vpp_fewer_samples_than_pp", ["actor.megatron.pipeline_model_parallel_size=2",
                                   "actor.megatron.virtual_pipeline_model_parallel_size=2", "rollout.n=2",
                                   "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=1"],
     ["actor.megatron.virtual_pipeline_model_parallel_size=2", "gets 1 sample(s)", "actor.ppo_mini_batch_size to 2"]),
    ("vpp_without_pp", ["ref.megatron.virtual_pipeline_model_parallel_size=2"], ["ref.megatron.virtual_pipeline_model_parallel_size"]),
    ("sequence_parallel_without_tp", ["actor.megatron.sequence_parallel=true"], ["actor.megatron.sequence_parallel"]),
    ("ep_on_dense_model", ["actor.megatron.expert_model_parallel_size=2"], ["actor.megatron.expert_model_parallel_size=2"]),
    ("tp_across_nodes", ["cluster.device=cuda", "cluster.n_gpus_per_node=2", "cluster.nnodes=2",
                         "actor.megatron.tensor_model_parallel_size=4"],
     ["actor.megatron.tensor_model_parallel_size=4", "spans nodes"]),
    ("kl_loss_without_reference", ["ref.enable=false"], ["actor.use_kl_loss", "ref.enable=false"]),
    ("blend_without_reference", ["actor.use_kl_loss=false", "ref.enable=false", "algorithm.ref_reward_blend.enable=true"],
     ["algorithm.ref_reward_blend.enable", "ref.enable"]),
    ("repr_align_without_reference", ["actor.use_kl_loss=false", "ref.enable=false", "algorithm.repr_align.enable=true"],
     ["algorithm.repr_align.enable", "ref.enable=false"]),
    ("double_kl", ["algorithm.use_kl_in_reward=true"], ["actor.use_kl_loss", "algorithm.use_kl_in_reward", "allow_double_kl"]),
    ("grpo_with_n1", ["rollout.n=1", "actor.ppo_micro_batch_size_per_gpu=1"], ["algorithm.adv_estimator=grpo", "rollout.n"]),
    ("rloo_with_n1", ["algorithm.adv_estimator=rloo", "rollout.n=1", "actor.ppo_micro_batch_size_per_gpu=1"],
     ["algorithm.adv_estimator=rloo", "rollout.n"]),
    ("gae_without_critic", ["algorithm.adv_estimator=gae", "critic.enable=false"], ["algorithm.adv_estimator=gae", "critic.enable"]),
    ("critic_warmup_without_critic", ["trainer.critic_warmup=2"], ["trainer.critic_warmup"]),
    ("critic_micro_missing", ["algorithm.adv_estimator=gae"], ["critic.ppo_micro_batch_size_per_gpu"]),
    ("temperature_zero", ["rollout.temperature=0"], ["rollout.temperature"]),
    ("top_k_zero", ["rollout.top_k=0"], ["rollout.top_k"]),
    ("val_sample_without_temperature", ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.n=4"],
     ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature > 0"]),
    ("val_sample_top_k_zero", ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1",
                               "rollout.val_kwargs.top_k=0"], ["rollout.val_kwargs.top_k=0"]),
    ("val_greedy_with_n", ["rollout.val_kwargs.n=4"], ["rollout.val_kwargs.n=4", "do_sample=false", "identical"]),
    ("val_greedy_ignores_temperature", ["rollout.val_kwargs.temperature=0.6", "rollout.val_kwargs.top_p=0.95"],
     ["rollout.val_kwargs.temperature=0.6, top_p=0.95", "ignored", "do_sample=true"]),
    ("val_generations_negative", ["trainer.log_val_generations=-1"], ["trainer.log_val_generations"]),
    ("positions_exceeded", ["rollout.max_response_length=200"], ["data.max_prompt_length", "rollout.max_response_length",
                                                                 "max_position_embeddings=256"]),
    ("engine_tp_not_dividing", ["rollout.engine_tp_size=3"], ["rollout.engine_tp_size=3", "does not divide"]),
    ("too_many_colocated_engines", ["rollout.num_engines=3", "rollout.engine_tp_size=2"], ["rollout.num_engines", "exceeds"]),
    # the built-in engine has no TP (issue 53): refused on CPU and on CUDA, where it hung 600 s in the weight sync
    ("torch_engine_tp_cpu", ["rollout.engine_tp_size=2"], ["rollout.engine_tp_size=2 with rollout.engine=torch",
                                                          "fix: rollout.engine_tp_size=1", "rollout.engine=sglang"]),
    ("torch_engine_tp_cuda", ["cluster.device=cuda", "rollout.placement=separate", "rollout.num_engines=1",
                              "rollout.engine_tp_size=2", "rollout.weight_sync.transport=distributed"],
     ["rollout.engine_tp_size=2 with rollout.engine=torch", "fix: rollout.engine_tp_size=1"]),
    # issue 53: agent.* on a non-agent run is refused like actor.lora.* without a rank; an absurd finite aux-loss
    # weight is refused by its bound (nan/inf by allow_inf_nan) instead of a NaN grad norm at step 1
    ("agent_key_without_agent", ["agent.tool_memory_mb=2048"], ["agent.tool_memory_mb is set but agent.enable=false",
                                                                "remove agent.tool_memory_mb"]),
    ("moe_aux_loss_coef_absurd", ["actor.moe.aux_loss_coef=1e308"], ["actor.moe.aux_loss_coef", "beyond 1",
                                                                     "outweighs the policy loss", "fix:"]),
    ("sglang_on_cpu", ["rollout.engine=sglang"], ["rollout.engine=sglang", "cluster.device=cpu"]),
    ("sglang_verify", ["cluster.device=cuda", "rollout.engine=sglang", "rollout.weight_sync.verify=true"],
     ["rollout.weight_sync.verify=true", "/weights_checksum", "fix: rollout.weight_sync.verify=false"]),
    ("tensor_sync_with_separate_engines", ["rollout.placement=separate", "rollout.num_engines=2",
                                           "rollout.weight_sync.transport=tensor"], ["rollout.weight_sync.transport=tensor"]),
    ("separate_engines_take_everything", ["rollout.placement=separate", "rollout.num_engines=4"],
     ["leaving none for the actor", "rollout.num_engines=4 x rollout.engine_tp_size=1 = 4"]),
    ("separate_engines_without_count", ["rollout.placement=separate"], ["rollout.num_engines"]),
    ("separate_ref_without_devices", ["ref.placement=separate"], ["ref.num_devices"]),
    ("separate_ref_offload_not_built", ["ref.placement=separate", "ref.num_devices=1", "ref.offload=true"],
     ["ref.offload=true", "ref.placement=separate"]),
    ("ref_devices_while_colocated", ["ref.num_devices=2"], ["ref.num_devices", "placement=separate"]),
    ("save_freq_without_dir", ["trainer.save_freq=10", "trainer.default_local_dir=null"],
     ["trainer.save_freq", "trainer.default_local_dir"]),
    ("test_freq_without_val", ["trainer.test_freq=5"], ["trainer.test_freq", "data.val_files"]),
    ("resume_path_missing", ["trainer.resume_mode=/nonexistent/ckpt"], ["trainer.resume_mode"]),
    ("save_contents_without_model", ["actor.checkpoint.save_contents=[optimizer,extra]"],
     ["actor.checkpoint.save_contents=['optimizer', 'extra']", "lacks 'model'", "save_contents=[model,optimizer,extra]"]),
    ("load_contents_without_model", ["actor.checkpoint.load_contents=[optimizer]"],
     ["actor.checkpoint.load_contents=['optimizer']", "lacks 'model'", "load_contents=[model,optimizer]"]),
    ("checkpoint_content_unknown", ["actor.checkpoint.save_contents=[model,weights]"],
     ["actor.checkpoint.save_contents", "'hf_model'"]),
    ("val_only_without_val_before_train", ["trainer.val_only=true"], ["trainer.val_only=true", "trainer.val_before_train=true"]),
    ("kl_loss_type_full", ["actor.kl_loss_type=full"], ["actor.kl_loss_type=full", "low_var_kl"]),
    ("kl_penalty_full", ["algorithm.kl_penalty=full"], ["algorithm.kl_penalty=full", "not supported"]),
    ("both_warmups", ["actor.optim.lr_warmup_steps=10", "actor.optim.lr_warmup_steps_ratio=0.1"],
     ["actor.optim.lr_warmup_steps", "lr_warmup_steps_ratio"]),
    ("data_file_suffix", ["data.train_files=[prompts.csv]"], ["data.train_files[0]", "parquet"]),
    ("reward_function_syntax", ["reward.function=not valid!"], ["reward.function"]),
    ("reward_file_missing", ["reward.function=missing_rewards.py:score"], ["reward.function", "missing_rewards.py"]),
    ("adv_estimator_unknown", ["algorithm.adv_estimator=grpoo"],
     ["algorithm.adv_estimator='grpoo'", "did you mean 'grpo'", "remax", "file.py:fn"]),
    ("policy_loss_unknown", ["actor.policy_loss=gpso"], ["actor.policy_loss='gpso'", "did you mean 'gspo'"]),
    ("reward_unknown", ["reward.function=gsm9k"], ["reward.function='gsm9k'", "did you mean 'gsm8k'"]),
    ("plugin_file_missing", ["algorithm.adv_estimator=missing_plugin.py:grpo_difficulty"],
     ["algorithm.adv_estimator", "missing_plugin.py", "does not exist"]),
    ("plugin_module_missing", ["actor.policy_loss=no_such_pkg.losses:fn"],
     ["actor.policy_loss", "cannot import module 'no_such_pkg.losses'"]),
    ("plugin_no_such_function", [f"actor.policy_loss={_PLUGIN}:clipped_ad"],
     ["actor.policy_loss", "no callable 'clipped_ad'", "did you mean 'clipped_adv'", "grpo_difficulty"]),
    ("plugin_wrong_signature", [f"algorithm.adv_estimator={_PLUGIN}:too_few_arguments"],
     ["algorithm.adv_estimator", "too_few_arguments(token_level_rewards)", "cannot be called as mrl calls it"]),
    ("sampler_unknown", ["data.sampler.class_path=resumabel"], ["data.sampler.class_path='resumabel'", "did you mean 'resumable'"]),
    ("sampler_not_a_sampler", [f"data.sampler.class_path={_PLUGIN}:too_few_arguments"],
     ["data.sampler.class_path", "lacks next_batch"]),
    ("reward_plugin_wrong_signature", [f"reward.function={_PLUGIN}:too_few_arguments"],
     ["reward.function", "too_few_arguments", "solution_str"]),
    ("reward_model_without_path", ["reward_model.enable=true"], ["reward_model.model.path", "ForSequenceClassification"]),
    ("reward_model_with_remax", ["reward_model.enable=true", "reward_model.model.path=/nonexistent/rm",
                                 "algorithm.adv_estimator=remax"], ["reward_model.enable=true", "remax"]),
    ("reward_model_function_builtin", ["reward_model.enable=true", "reward_model.model.path=/nonexistent/rm",
                                       "reward_model.combine=function"], ["reward_model.combine=function", "rm_score"]),
    # reward_model.placement=separate: its own devices after the actor's, its own layout (docs/reward_model.md)
    ("rm_separate_without_devices", [*_RM, "reward_model.placement=separate"],
     ["reward_model.placement=separate needs reward_model.num_devices", "fix: set reward_model.num_devices"]),
    ("rm_devices_while_colocated", [*_RM, "reward_model.num_devices=2"],
     ["reward_model.num_devices is only used with reward_model.placement=separate", "fix"]),
    ("rm_colocated_layout_differs", [*_RM, "reward_model.megatron.tensor_model_parallel_size=2"],
     ["reward_model.megatron.tensor_model_parallel_size=2 (actor 1)", "fix: remove reward_model.megatron",
      "reward_model.placement=separate"]),
    ("rm_separate_tp_does_not_divide_devices", [*_RM_SEP, "reward_model.num_devices=3",
                                                "reward_model.megatron.tensor_model_parallel_size=2"],
     ["reward_model.megatron: TP*PP*CP = 2*1*1 = 2 does not divide the 3 devices of the reward_model",
      "fix: change reward_model.megatron.tensor_model_parallel_size"]),
    ("rm_separate_null_layout_does_not_fit", ["cluster.n_gpus_per_node=5", "actor.megatron.tensor_model_parallel_size=2",
                                              *_RM_SEP, "reward_model.num_devices=1"],
     ["reward_model.megatron is null", "actor.megatron's TP*PP*CP = 2", "reward_model.num_devices=1",
      "fix: set reward_model.megatron.tensor_model_parallel_size"]),
    ("rm_separate_sequence_parallel_tp1", [*_RM_SEP, "reward_model.num_devices=2", "reward_model.megatron.sequence_parallel=true"],
     ["reward_model.megatron.sequence_parallel=true", "fix"]),
    ("rm_separate_context_parallel_local", [*_RM_SEP, "reward_model.num_devices=2", "reward_model.megatron.context_parallel_size=2",
                                            "reward_model.megatron.attention_backend=local"],
     ["reward_model.megatron.context_parallel_size=2", "sdpa attention backend only",
      "fix: reward_model.megatron.context_parallel_size=1"]),
    ("rm_verl_resource_pool_keys", ["reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=2"],
     ["unknown key 'reward_model.enable_resource_pool'", "fix: verl's reward_pool is reward_model.placement=separate",
      "reward_model.num_devices"]),
    ("rm_separate_takes_every_device", [*_RM_SEP, "reward_model.num_devices=4"],
     ["reward_model.num_devices=4", "leaving none for the actor", "fix"]),
    ("rm_separate_offload", [*_RM_SEP, "reward_model.num_devices=2", "reward_model.offload=true"],
     ["reward_model.offload=true is not supported with reward_model.placement=separate", "fix: reward_model.offload=false"]),
    ("unknown_key_suggests", ["actor.optim.lrr=1e-6"], ["unknown key 'actor.optim.lrr'", "section 'actor.optim'", "'actor.optim.lr'"]),
    ("unknown_section", ["actor_rollout_ref.actor.optim.lr=1e-6"], ["unknown key 'actor_rollout_ref'", "'actor'", "'rollout'"]),
    ("unknown_nested_key", ["algorithm.ref_reward_blend.max_wieght=0.5"],
     ["algorithm.ref_reward_blend.max_wieght", "'algorithm.ref_reward_blend.max_weight'"]),
    ("bad_type", ["actor.ppo_epochs=many"], ["actor.ppo_epochs", "valid integer"]),
    ("lora_setting_without_rank", ["actor.lora.alpha=32"], ["actor.lora.alpha", "actor.lora.rank=0"]),
    ("lora_empty_targets", ["actor.lora.rank=8", "actor.lora.target_modules=[]"], ["actor.lora.target_modules", "empty"]),
    ("lora_all_linear_mixed", ["actor.lora.rank=8", "actor.lora.target_modules=[all-linear,q_proj]"],
     ["actor.lora.target_modules", "[all-linear] alone"]),
    ("lora_unknown_target", ["actor.lora.rank=8", "actor.lora.target_modules=[qkv_proj]"], ["actor.lora.target_modules"]),
    ("lora_gdn_target_on_plain_model", ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,in_proj_qkv]"],
     ["actor.lora.target_modules", "names in_proj_qkv", "no Gated DeltaNet layers"]),
    ("lora_separate_reference", ["actor.lora.rank=8", "ref.placement=separate", "ref.num_devices=1"],
     ["ref.placement=separate", "actor.lora.separate_reference=true"]),
    ("lora_separate_reference_unused", ["actor.lora.rank=8", "actor.lora.separate_reference=true"],
     ["actor.lora.separate_reference=true", "only used with ref.placement=separate"]),
    ("lora_sequence_parallel", ["actor.lora.rank=8", "actor.megatron.tensor_model_parallel_size=2",
                                "actor.megatron.sequence_parallel=true"], ["actor.megatron.sequence_parallel=true", "lora"]),
    ("lora_rank_above_hidden", ["actor.lora.rank=128"], ["actor.lora.rank=128", "hidden size 64"]),
    ("lora_negative_rank", ["actor.lora.rank=-1"], ["actor.lora.rank"]),
    ("bad_literal", ["rollout.engine=vllm"], ["rollout.engine", "'torch' or 'sglang'"]),
    ("bad_range", ["rollout.mem_fraction_static=1.5"], ["rollout.mem_fraction_static", "less than 1"]),
    ("bad_schedule", ["algorithm.repr_align.ref_alignment.schedule=quadratic"], ["algorithm.repr_align.ref_alignment.schedule"]),
    # found by an independent reliability round (issue 19): each was accepted before
    ("temperature_nan", ["rollout.temperature=.nan"], ["rollout.temperature", "finite number"]),
    ("temperature_inf", ["rollout.temperature=.inf"], ["rollout.temperature", "finite number"]),
    ("lr_inf", ["actor.optim.lr=.inf"], ["actor.optim.lr", "finite number"]),
    ("kl_loss_coef_inf", ["actor.kl_loss_coef=.inf"], ["actor.kl_loss_coef", "finite number"]),
    ("betas_out_of_range", ["actor.optim.betas=[1.5,-2]"], ["actor.optim.betas", "[0, 1)"]),
    ("seed_too_large", ["trainer.seed=1.0e+23"], ["trainer.seed", "maximum size"]),
    ("seed_huge_int", ["trainer.seed=100000000000000000000000"], ["trainer.seed", "less than"]),
    ("data_seed_negative", ["data.seed=-1"], ["data.seed", "greater than or equal to 0"]),
    ("lr_bool", ["actor.optim.lr=true"], ["actor.optim.lr", "boolean", "expected a number"]),
    ("ppo_epochs_bool", ["actor.ppo_epochs=true"], ["actor.ppo_epochs", "boolean", "expected a number"]),
    ("host_not_an_address", ["rollout.host=not an address"], ["rollout.host", "neither an IP address nor a host name"]),
    ("reward_function_unknown_name", ["reward.function=gsm8kk"], ["reward.function='gsm8kk'", "not a registered scorer", "gsm8k"]),
    # repr_align embeds under the colocated reference's swapped-in weights; a separate one computes log-probs only
    ("repr_align_separate_ref", ["algorithm.repr_align.enable=true", "ref.placement=separate", "ref.num_devices=2"],
     ["algorithm.repr_align.enable=true", "fix: ref.placement=colocated"]),
    ("cpus_fewer_than_ranks", ["cluster.cpus_per_node=2"], ["cluster.cpus_per_node=2", "4 ranks"]),
    # off-policy schedule (mrl/config/async_training.py, docs/async.md)
    ("partial_rollout_without_async", ["rollout.partial_rollout=true"],
     ["rollout.partial_rollout=true", "trainer.async_training.max_staleness=1"]),
    ("async_with_engine_memory_release", ["trainer.async_training.max_staleness=1", "rollout.free_cache_engine=true"],
     ["trainer.async_training.max_staleness=1", "rollout.free_cache_engine", "rollout.placement=separate"]),
    ("async_colocated_cuda_releases_memory", ["trainer.async_training.max_staleness=2", "cluster.device=cuda"],
     ["max_staleness=2", "on by default for colocated engines on CUDA"]),
    ("async_with_dynamic_sampling", ["trainer.async_training.max_staleness=1", "algorithm.filter_groups.enable=true",
                                     "algorithm.filter_groups.metric=acc"],
     ["max_staleness=1", "algorithm.filter_groups.enable=true"]),
    ("async_with_remax", ["trainer.async_training.max_staleness=1", "algorithm.adv_estimator=remax"],
     ["max_staleness=1", "algorithm.adv_estimator=remax"]),
    ("async_negative_staleness", ["trainer.async_training.max_staleness=-1"], ["trainer.async_training.max_staleness"]),
    # rollout correction (verl's algorithm.rollout_correction keys) and the losses with their own rules
    ("rollout_is_unknown_level", ["algorithm.rollout_correction.rollout_is=tokens"], ["algorithm.rollout_correction.rollout_is"]),
    ("rollout_is_threshold_not_a_number", ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=abc"],
     ["algorithm.rollout_correction.rollout_is_threshold='abc'", "0.5_5.0"]),
    ("rollout_is_threshold_lower_above_upper", ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold='5.0_0.5'"],
     ["algorithm.rollout_correction.rollout_is_threshold='5.0_0.5'", "0 < L <= U"]),
    ("rollout_is_threshold_not_positive", ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=-1"],
     ["algorithm.rollout_correction.rollout_is_threshold=-1", "U > 0"]),
    ("rollout_rs_unknown_option", ["algorithm.rollout_correction.rollout_rs=token_k4", "algorithm.rollout_correction.rollout_rs_threshold=2"], ["algorithm.rollout_correction.rollout_rs", "token_k4"]),
    ("rollout_rs_without_threshold", ["algorithm.rollout_correction.rollout_rs=seq_mean_k1"], ["algorithm.rollout_correction.rollout_rs='seq_mean_k1'", "rollout_rs_threshold"]),
    ("rollout_rs_k2_with_ratio_bounds", ["algorithm.rollout_correction.rollout_rs=token_k2", "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'"],
     ["algorithm.rollout_correction.rollout_rs_threshold", "token_k2", "one upper bound"]),
    ("rollout_rs_threshold_count", ["algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k3,token_k2'", "algorithm.rollout_correction.rollout_rs_threshold='2,0.1'"],
     ["algorithm.rollout_correction.rollout_rs_threshold", "3 (one per option)"]),
    ("rollout_rs_threshold_without_rs", ["algorithm.rollout_correction.rollout_rs_threshold=2"], ["algorithm.rollout_correction.rollout_rs_threshold", "ignored"]),
    ("rollout_batch_normalize_without_is", ["algorithm.rollout_correction.rollout_is_batch_normalize=true"], ["algorithm.rollout_correction.rollout_is_batch_normalize"]),
    ("rollout_bypass_mode", ["algorithm.rollout_correction.bypass_mode=true"], ["algorithm.rollout_correction.bypass_mode=true", "decoupled"]),
    ("rollout_loss_type_without_bypass", ["algorithm.rollout_correction.loss_type=reinforce"], ["algorithm.rollout_correction.loss_type=reinforce"]),
    ("tis_cap_and_rollout_is", ["actor.tis_imp_ratio_cap=2", "algorithm.rollout_correction.rollout_is=token"],
     ["actor.tis_imp_ratio_cap", "algorithm.rollout_correction.rollout_is", "applied twice"]),
    ("sapo_with_token_mean", ["actor.policy_loss=sapo"], ["actor.policy_loss=sapo", "actor.loss_agg_mode=seq-mean-token-mean"]),
    ("geo_mean_with_token_mean", ["actor.policy_loss=geo_mean", "actor.loss_agg_mode=token-sum"],
     ["actor.policy_loss=geo_mean", "actor.loss_agg_mode=token-sum"]),
    ("passk_with_n1", ["algorithm.adv_estimator=grpo_passk", "rollout.n=1", "actor.ppo_micro_batch_size_per_gpu=1"],
     ["algorithm.adv_estimator=grpo_passk", "rollout.n >= 2"]),
    ("clip_cov_bounds_reversed", ["actor.policy_loss_params.clip_cov_lb=6"], ["actor.policy_loss_params.clip_cov_lb=6.0"]),
    ("clip_cov_ratio_zero", ["actor.policy_loss_params.clip_cov_ratio=0"], ["actor.policy_loss_params.clip_cov_ratio"]),
    ("sapo_tau_zero", ["actor.tau_pos=0"], ["actor.tau_pos"]),
    ("loss_agg_mode_unknown", ["actor.loss_agg_mode=token_sum"], ["actor.loss_agg_mode"]),
    # the in-process engine: CPU, built-in engine, colocated one-rank engines, ranks holding the whole model
    # colocated engines share the trainer ranks' GPUs: NCCL refuses them in one group with those ranks, and
    # CUDA IPC handles do not cross nodes (docs/cuda_check.md, docs/weight_sync.md)
    ("distributed_colocated_cuda", ["cluster.device=cuda", "rollout.weight_sync.transport=distributed"],
     ["transport=distributed", "placement=colocated on CUDA", "fix: rollout.weight_sync.transport=tensor"]),
    ("distributed_colocated_cuda_two_nodes", ["cluster.device=cuda", "cluster.nnodes=2", "cluster.n_gpus_per_node=2",
                                              "rollout.weight_sync.transport=distributed"],
     ["transport=distributed", "NCCL refuses", "fix: rollout.placement=separate"]),
    ("tensor_colocated_cuda_two_nodes", ["cluster.device=cuda", "cluster.nnodes=2", "cluster.n_gpus_per_node=2",
                                         "rollout.weight_sync.transport=tensor"],
     ["transport=tensor", "cluster.nnodes=2", "fix: rollout.placement=separate"]),
    ("inprocess_on_cuda", ["rollout.weight_sync.transport=inprocess", "cluster.device=cuda"],
     ["transport=inprocess", "cluster.device=cuda", "fix: rollout.weight_sync.transport=tensor"]),
    ("inprocess_tp2", ["rollout.weight_sync.transport=inprocess", "actor.megatron.tensor_model_parallel_size=2"],
     ["transport=inprocess", "actor TP=2", "TP = PP = 1"]),
    ("inprocess_separate", ["rollout.weight_sync.transport=inprocess", "rollout.placement=separate",
                            "rollout.num_engines=1", "cluster.n_gpus_per_node=5"],
     ["transport=inprocess", "rollout.placement=separate"]),
    ("inprocess_fewer_engines", ["rollout.weight_sync.transport=inprocess", "rollout.num_engines=2"],
     ["transport=inprocess", "rollout.num_engines=2", "one per trainer rank"]),
    ("inprocess_snapshot", ["rollout.weight_sync.transport=inprocess", "rollout.weight_sync.snapshot_dir=/tmp/x"],
     ["transport=inprocess", "snapshot_dir", "never restarted"]),
    ("inprocess_async", ["rollout.weight_sync.transport=inprocess", "trainer.async_training.max_staleness=1"],
     ["transport=inprocess", "max_staleness=1", "synchronous steps only"]),
]


def _errors(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    return ei.value.errors


def test_base_is_valid(base_overrides: list[str]) -> None:
    cfg = load_config(None, base_overrides)
    errors, notes = check_config(cfg)
    assert errors == [] and all("holds config.json but no weights here (yet)" in n for n in notes)  # config.json only


def test_val_sampling_is_valid(base_overrides: list[str]) -> None:
    v = "rollout.val_kwargs"
    cfg = load_config(None, base_overrides + [f"{v}.do_sample=true", f"{v}.n=4", f"{v}.temperature=0.6", f"{v}.top_p=0.95"])
    assert check_config(cfg)[0] == []
    assert cfg.rollout.val_kwargs.n == 4 and cfg.rollout.val_kwargs.top_k == -1


def test_dapo_settings_are_valid(base_overrides: list[str]) -> None:
    cfg = load_config(None, base_overrides + [
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "rollout.n=4",
        "algorithm.filter_groups.max_num_gen_batches=3", "data.gen_batch_size=16", "actor.clip_ratio_high=0.28",
        "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=8"])
    assert check_config(cfg)[0] == []


@pytest.mark.parametrize("extra", [
    ["algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold='0.5_5.0'",
     "algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k3'",
     "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,0.1'", "actor.policy_loss=cispo"],
    ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_batch_normalize=true",
     "actor.policy_loss=sapo", "actor.loss_agg_mode=seq-mean-token-mean", "actor.tau_neg=1.2"],
    ["actor.policy_loss=clip_cov", "actor.policy_loss_params.clip_cov_ratio=0.01", "actor.loss_agg_mode=token-sum",
     "algorithm.adv_estimator=grpo_passk"],
], ids=["corr+cispo", "token-is+sapo", "clip_cov+passk"])
def test_new_losses_and_rollout_correction_are_valid(base_overrides: list[str], extra: list[str]) -> None:
    cfg = load_config(None, base_overrides + extra)
    assert check_config(cfg)[0] == []


@pytest.mark.parametrize("case, extra, must_contain", BAD, ids=[c[0] for c in BAD])
def test_bad_config_names_the_key(case: str, extra: list[str], must_contain: list[str], base_overrides: list[str]) -> None:
    errors = _errors(base_overrides + extra)
    assert any(all(s in e for s in must_contain) for e in errors), f"{case}: no error contains {must_contain}: {errors}"
    # every message tells the user what to do
    assert all("fix" in e or "did you mean" in e for e in errors), errors


def test_unreadable_model_config_names_model_path(base_overrides: list[str], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    errors = _errors(base_overrides + [f"model.path={tmp_path}"])
    assert any(e.startswith("model.path:") and "config.json" in e for e in errors), errors


def test_all_cross_field_errors_reported_together(base_overrides: list[str]) -> None:
    errors = _errors(base_overrides + ["rollout.temperature=0", "actor.kl_loss_type=full", "trainer.test_freq=5"])
    assert len(errors) == 3, errors


def test_missing_model_is_a_note_not_an_error(base_overrides: list[str]) -> None:
    cfg = load_config(None, base_overrides + ["model.path=Org/not-downloaded-here", "actor.megatron.tensor_model_parallel_size=4"])
    errors, notes = check_config(cfg)
    assert errors == []
    assert len(notes) == 1 and "model.path='Org/not-downloaded-here'" in notes[0] and "skipped" in notes[0]


def test_sglang_router_needs_its_package(base_overrides: list[str], monkeypatch) -> None:
    import importlib.util

    from mrl.config import validate
    cfg = load_config(None, base_overrides + ["rollout.router=sglang_router"])  # torch engines: same protocol
    real = importlib.util.find_spec
    monkeypatch.setattr(validate.importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else real(name, *a))
    errors, _ = check_config(cfg)
    assert any("rollout.router=sglang_router" in e and "pip install sglang-router" in e for e in errors), errors


def test_sglang_on_cuda_host_config_is_valid(base_overrides: list[str]) -> None:
    cfg = load_config(None, base_overrides + ["cluster.device=cuda", "rollout.engine=sglang", "rollout.router=sglang_router",
                                              "rollout.weight_sync.transport=tensor"])
    assert cfg.rollout.engine == "sglang"


def test_double_kl_allowed_explicitly(base_overrides: list[str]) -> None:
    cfg = load_config(None, base_overrides + ["algorithm.use_kl_in_reward=true", "algorithm.allow_double_kl=true"])
    assert cfg.ref_enabled and cfg.algorithm.use_kl_in_reward


def test_repr_align_builds_the_reference(base_overrides: list[str]) -> None:
    # repr_align embeds with the reference (initial) weights: it alone turns the reference on
    on = load_config(None, base_overrides + ["actor.use_kl_loss=false", "algorithm.repr_align.enable=true"])
    off = load_config(None, base_overrides + ["actor.use_kl_loss=false", "algorithm.repr_align.enable=true",
                                              "algorithm.repr_align.ref_alignment.enable=false"])
    assert on.ref_enabled and on.repr_align_enabled
    assert not off.ref_enabled and not off.repr_align_enabled


def test_more_ranks_than_local_gpus_is_refused(base_overrides: list[str], monkeypatch) -> None:
    # issue 19: accepted, then Ray waited for the placement group until its timeout
    from mrl.config import validate

    monkeypatch.setattr(validate.glob, "glob", lambda pat: ["/dev/nvidia0", "/dev/nvidia1"] if "nvidia" in pat else [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cuda = ["cluster.device=cuda", "model.dtype=bfloat16", "rollout.weight_sync.transport=tensor"]
    errors = _errors(base_overrides + cuda)  # 4 ranks per node, 2 GPUs here
    assert any("cluster.n_gpus_per_node=4" in e and "exposes 2 GPU(s)" in e for e in errors), errors
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert any("exposes 1 GPU(s)" in e for e in _errors(base_overrides + cuda + ["cluster.n_gpus_per_node=2",
                                                                                  "actor.ppo_micro_batch_size_per_gpu=1"]))
    # a cluster (address set or several nodes) is not judged by this host's devices
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert not [e for e in check_config(load_config(None, base_overrides + cuda + ["cluster.address=auto"]))[0]
                if "GPU(s)" in e]


def test_async_settings_are_valid(base_overrides: list[str]) -> None:
    """Separate engines, or colocated ones that keep their memory, may run ahead of the trainer."""
    sep = ["rollout.placement=separate", "rollout.num_engines=2", "cluster.n_gpus_per_node=6",
           "rollout.weight_sync.transport=distributed"]
    for extra in (["trainer.async_training.max_staleness=2", "rollout.partial_rollout=true", "rollout.max_num_seqs=8",
                   "actor.tis_imp_ratio_cap=2"], ["trainer.async_training.max_staleness=1"] + sep):
        errors, notes = check_config(load_config(None, base_overrides + extra))
        assert errors == [], extra
        # off-policy samples without an importance-sampling correction: said in the plan
        assert any("actor.tis_imp_ratio_cap" in n for n in notes) == ("actor.tis_imp_ratio_cap=2" not in extra)


def test_shared_prefix_refused_with_transformer_engine_attention(base_overrides: list[str], monkeypatch) -> None:
    import importlib.util

    from mrl.config import validate
    real = importlib.util.find_spec
    te = object()
    monkeypatch.setattr(validate.importlib.util, "find_spec", lambda name, *a: te if name == "transformer_engine" else real(name, *a))
    with pytest.raises(ConfigError, match=r"actor.shared_prefix=true .*Transformer Engine.*fix: actor.megatron.attention_backend=sdpa, "
                       r"or actor.shared_prefix=false"):
        load_config(None, base_overrides + ["cluster.device=cuda", "actor.shared_prefix=true"])
    cpu = load_config(None, base_overrides + ["cluster.device=cpu", "actor.shared_prefix=true"])
    assert not [e for e in check_config(cpu)[0] if "shared_prefix" in e]


def test_inprocess_engines_fit_a_cpu_colocated_run(base_overrides: list[str]) -> None:
    cfg = load_config(None, base_overrides + ["rollout.weight_sync.transport=inprocess"])
    assert cfg.rollout.weight_sync.transport == "inprocess" and not check_config(cfg)[0]


# issue 52: context parallelism runs for the actor, reference and critic on sdpa with packed rows; the rest is
# refused at plan time in one line naming why
def test_context_parallel_plans_for_actor_ref_and_critic(base_overrides: list[str]) -> None:
    cfg = load_config(None, base_overrides + ["actor.megatron.context_parallel_size=2", "algorithm.adv_estimator=gae",
                                              "critic.ppo_micro_batch_size_per_gpu=2",
                                              "critic.megatron.context_parallel_size=2"])
    assert check_config(cfg)[0] == []
    from mrl.config.plan_report import build_report, format_report

    text = format_report(cfg, build_report(cfg))
    assert "TP=1 PP=1 CP=2 DP=2" in text and "CP=2: each device holds 1/2 of every sequence's tokens" in text
    # LoRA under CP (tests/workers/test_context_parallel.py: adapters, gradients, reference at CP2 = CP1)
    assert check_config(load_config(None, base_overrides + ["actor.megatron.context_parallel_size=2",
                                                            "actor.lora.rank=8"]))[0] == []
    # interleaved stages under CP (tests/workers/test_interleaved_pipeline.py: CP2 x PP2 x VPP2 = transformers)
    assert check_config(load_config(None, base_overrides + [
        "actor.megatron.context_parallel_size=2", "actor.megatron.pipeline_model_parallel_size=2",
        "actor.megatron.virtual_pipeline_model_parallel_size=2"]))[0] == []


_CP_REFUSED = [  # (case, overrides, why the one line must name)
    ("not_packed", ["actor.use_remove_padding=false"], "it needs actor.use_remove_padding"),
    ("local_attention", ["actor.megatron.attention_backend=local", "actor.use_remove_padding=false"],
     "sdpa attention backend only"),
]


def test_context_parallel_token_budget_is_per_device(base_overrides: list[str]) -> None:
    """With CP a micro-batch row spreads over the CP devices: the per-device budget times CP must hold a sequence."""
    seq = ["data.max_prompt_length=64", "rollout.max_response_length=64", "actor.use_dynamic_bsz=true"]
    cfg = load_config(None, base_overrides + seq + ["actor.megatron.context_parallel_size=2",
                                                    "actor.ppo_max_token_len_per_gpu=64"])
    assert check_config(cfg)[0] == []  # 64 per device x CP 2 = one 128-token sequence
    errors = _errors(base_overrides + seq + ["actor.megatron.context_parallel_size=2", "actor.ppo_max_token_len_per_gpu=63"])
    assert any("over CP=2 devices" in e and "fix: set actor.ppo_max_token_len_per_gpu >= 64" in e for e in errors), errors


def test_context_parallel_plans_for_a_separate_reference(base_overrides: list[str]) -> None:
    """Issue 52: a separate reference runs CP too (tests/workers/test_context_parallel.py, ReferenceWorker), on the
    packed rows the actor's forwards use (an actor at CP1 may pick the shared-prefix rows instead: then it says so)."""
    sep = ["ref.placement=separate", "ref.num_devices=2", "ref.megatron.context_parallel_size=2"]
    cfg = load_config(None, base_overrides + sep, check=False)  # auto: packed rows, no shared prefix
    assert not [e for e in check_config(cfg)[0] if "context_parallel_size" in e]
    cp = [e for e in _errors(base_overrides + sep + ["actor.use_remove_padding=false"]) if "context_parallel_size" in e]
    assert len(cp) == 1 and cp[0].startswith("ref.megatron.context_parallel_size=2: ") and "use_remove_padding" in cp[0]


@pytest.mark.parametrize("case, extra, why", _CP_REFUSED, ids=[c for c, _, _ in _CP_REFUSED])
def test_context_parallel_refusals_name_why(case: str, extra: list[str], why: str, base_overrides: list[str]) -> None:
    key = "actor.megatron.context_parallel_size"
    errors = _errors(base_overrides + extra + [f"{key}=2"])
    cp = [e for e in errors if "context_parallel_size" in e]
    assert len(cp) == 1 and cp[0].startswith(f"{key}=2: ") and why in cp[0] and f"fix: {key}=1" in cp[0], errors
    assert "\n" not in cp[0]


_TEACHER_SEP = ["algorithm.distill.mode=kl_loss", "teacher.enable=true", "teacher.placement=separate",
                "teacher.num_devices=2"]


@pytest.mark.parametrize("role, extra", [("teacher", _TEACHER_SEP), ("reward_model", [*_RM_SEP, "reward_model.num_devices=2"])],
                         ids=["teacher", "reward_model"])
def test_context_parallel_plans_for_the_teacher_and_reward_model(role: str, extra: list[str],
                                                                 base_overrides: list[str], tiny_model: Path) -> None:
    """Issue 52: the teacher and the reward model run CP (tests/workers/test_context_parallel.py); `mrl plan` prints
    it on their line; the reward model packs its rows under CP even with actor.use_remove_padding=false."""
    from mrl.config.plan_report import build_report, format_report

    key = f"{role}.megatron.context_parallel_size"
    extra = [*extra, f"teacher.path={tiny_model}"] if role == "teacher" else extra
    cfg = load_config(None, base_overrides + extra + [f"{key}=2"])
    assert check_config(cfg)[0] == []
    line = [ln for ln in format_report(cfg, build_report(cfg)).splitlines() if ln.strip().startswith(role)]
    assert line and "CP=2 DP=1" in line[0], line
    if role == "reward_model":
        assert check_config(load_config(None, base_overrides + extra + [f"{key}=2", "actor.use_remove_padding=false"],
                                        check=False))[0] == []
    else:  # the teacher's log-probs come from packed rows like the actor's
        errors = _errors(base_overrides + extra + [f"{key}=2", "actor.use_remove_padding=false"])
        assert any(e.startswith(f"{key}=2: ") and "actor.use_remove_padding" in e for e in errors), errors


def test_context_parallel_taken_from_the_actor_is_said_once(base_overrides: list[str], tiny_model: Path) -> None:
    """Separate side models with null megatron sections run at the actor's sizes: a CP refusal that holds for them
    names the actor's key (or a section of their own) once for both, next to the actor's own line."""
    errors = _errors(base_overrides + [*_RM_SEP, "reward_model.num_devices=2", *_TEACHER_SEP, f"teacher.path={tiny_model}",
                                       "cluster.n_gpus_per_node=8", "actor.megatron.context_parallel_size=2",
                                       "actor.megatron.attention_backend=local", "actor.use_remove_padding=false"])
    cp = [e for e in errors if e.startswith("actor.megatron.context_parallel_size=2: ")]
    assert len(cp) == 2 and sum("megatron section of its own" in e for e in cp) == 1, errors


@pytest.mark.parametrize("cmd", ["plan", "train"])
def test_cli_refuses_context_parallel_before_anything_starts(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    from mrl.cli import EXIT_CONFIG, main

    quickstart = Path(__file__).resolve().parents[2] / "mrl_configs" / "quickstart.yaml"  # 2 ranks: CP=2 divides them
    assert main([cmd, str(quickstart), "actor.megatron.context_parallel_size=2", "actor.use_remove_padding=false"]
                ) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "nothing was started" in err
    lines = [ln for ln in err.splitlines() if "actor.megatron.context_parallel_size" in ln]
    assert len(lines) == 1 and "fix: actor.megatron.context_parallel_size=1" in lines[0], err
    assert "more characters" not in lines[0]  # the whole message fits the CLI's per-error limit


def test_a_tool_memory_limit_above_the_hard_ulimit_is_refused_at_plan_time() -> None:
    """Issue 45: agent.tool_memory_mb above the hard RLIMIT_AS (which the driver's tool workers inherit, so each
    would die at its setrlimit) is refused by the config check with the key named, not at the first tool call.
    The hard limit is lowered in a child process: no process can raise it again."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import json, resource\n"
            "resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))  # 16 GiB, soft = hard\n"
            "from mrl.config import check_config, load_config\n"
            "for mb in (32768, 16384, 8192):\n"
            "    cfg = load_config('mrl_configs/quickstart_agent.yaml', [f'agent.tool_memory_mb={mb}'], check=False)\n"
            "    print(json.dumps([e for e in check_config(cfg)[0] if 'tool_memory_mb' in e]))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)}, check=False)
    assert out.returncode == 0, out.stderr
    over, at, under = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert len(over) == 1 and over[0].startswith("agent.tool_memory_mb=32768: "), over
    assert "hard RLIMIT_AS of 16384 MiB" in over[0] and "fix: a smaller agent.tool_memory_mb" in over[0]
    assert at == [] and under == []  # at the hard limit and below it: the workers can take it
