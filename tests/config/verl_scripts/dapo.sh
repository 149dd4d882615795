#!/usr/bin/env bash
# A DAPO launch in the shape of verl's recipe/dapo scripts (written for mrl's tests): ${VAR:-default},
# $((arithmetic)), Hydra '+' keys, filter_groups, clip-higher and the overlong buffer.
set -euo pipefail
project=dapo_test
run_name=qwen-math-dapo
max_prompt_length=$((512 * 2))
max_response_length=$((1024 * 3))
overlong_len=$((512 * 2))
prompts_per_step=64
gen_prompts=$((prompts_per_step * 3))
NNODES=${NNODES:-1}
GPUS=${GPUS:-8}
DATA_HOME=${DATA_HOME:-"/shared/rl"}
MODEL_PATH=${MODEL_PATH:-"${DATA_HOME}/models/Qwen2.5-Math-1.5B"}
CKPT_DIR=${CKPT_DIR:-"${DATA_HOME}/ckpts/${project}/${run_name}"}
actor_token_len=$(((max_prompt_length + max_response_length) * 2))

python3 -m recipe.dapo.main_dapo \
    data.train_files="${DATA_HOME}/dapo-17k.parquet" \
    data.val_files="${DATA_HOME}/aime24.parquet" \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.train_batch_size=${prompts_per_step} \
    data.gen_batch_size=${gen_prompts} \
    actor_rollout_ref.rollout.n=16 \
    algorithm.adv_estimator=grpo \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=acc \
    algorithm.filter_groups.max_num_gen_batches=10 \
    actor_rollout_ref.actor.clip_ratio_low=0.2 \
    actor_rollout_ref.actor.clip_ratio_high=0.28 \
    actor_rollout_ref.actor.clip_ratio_c=10.0 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${actor_token_len} \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.grad_clip=1.0 \
    actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    +actor_rollout_ref.model.override_config.max_position_embeddings=32768 \
    actor_rollout_ref.rollout.name=sglang \
    actor_rollout_ref.rollout.val_kwargs.do_sample=True \
    actor_rollout_ref.rollout.val_kwargs.temperature=0.6 \
    reward_model.reward_manager=dapo \
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True \
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=${overlong_len} \
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0 \
    +reward_model.reward_kwargs.overlong_buffer_cfg.log=False \
    trainer.project_name="${project}" \
    trainer.experiment_name="${run_name}" \
    trainer.n_gpus_per_node="${GPUS}" \
    trainer.nnodes="${NNODES}" \
    trainer.default_local_dir="${CKPT_DIR}" \
    trainer.total_training_steps=300
