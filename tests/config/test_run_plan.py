"""The frozen run plan: derived values computed once, from the config alone (plus the resolved device)."""
from __future__ import annotations

import dataclasses

import pytest

from mrl.config import load_config
from mrl.config.run_plan import plan_run

RECIPE = "mrl_configs/quickstart.yaml"


def _cfg(tmp_path, *overrides: str):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "t.jsonl").write_text("")
    return load_config(RECIPE, [f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]", *overrides])


def test_lr_schedule_length_is_steps_times_mini_batches_times_epochs(tmp_path) -> None:
    cfg = _cfg(tmp_path, "trainer.total_training_steps=10", "data.train_batch_size=8", "actor.ppo_mini_batch_size=2",
               "actor.ppo_micro_batch_size_per_gpu=2", "actor.ppo_epochs=3", "rollout.n=4")
    a = plan_run(cfg, "cpu").actor
    assert (a.mini_batches_per_step, a.epochs, a.total_optimizer_steps, a.mini_batch_size_samples) == (4, 3, 120, 8)


def test_epoch_runs_take_their_length_from_the_samplers_batches(tmp_path) -> None:
    # verl: total_training_steps = len(train_dataloader) x total_epochs; an LR decay needs no step count in the config
    cfg = _cfg(tmp_path, "trainer.total_training_steps=null", "trainer.total_epochs=3", "actor.optim.lr_schedule=cosine",
               "actor.optim.lr_warmup_steps_ratio=0.1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
               "actor.ppo_micro_batch_size_per_gpu=4")
    p = plan_run(cfg, "cpu", batches_per_epoch=12)
    assert p.total_steps == 36 and p.actor.total_optimizer_steps == 36 * 2
    assert plan_run(cfg, "cpu").total_steps is None  # rows unknown (mrl plan before the data exists)
    # <role>.optim.total_training_steps: a schedule spanning other than the run (not silently ignored)
    longer = _cfg(tmp_path, "trainer.total_training_steps=null", "trainer.total_epochs=3", "data.train_batch_size=8",
                  "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4", "actor.optim.total_training_steps=100")
    assert plan_run(longer, "cpu", batches_per_epoch=12).actor.total_optimizer_steps == 100 * 2
    fixed = _cfg(tmp_path, "trainer.total_training_steps=7", "trainer.total_epochs=3")
    assert plan_run(fixed, "cpu", batches_per_epoch=12).total_steps == plan_run(fixed, "cpu").total_steps == 7


def test_plan_prints_the_run_length_the_rows_give(tmp_path) -> None:
    from mrl.config.data_files import run_length_text

    cfg = _cfg(tmp_path, "trainer.total_training_steps=null", "trainer.total_epochs=3", "data.train_batch_size=8",
               "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4")
    assert run_length_text(cfg, 100).startswith("36 steps (trainer.total_epochs=3 x 12 batches of 8 prompts")
    assert "rows unknown" in run_length_text(cfg, None)
    assert run_length_text(_cfg(tmp_path, "trainer.total_training_steps=5"), 100) == "5 steps (trainer.total_training_steps)"


def test_the_critic_falls_back_to_the_actors_mini_batch_and_epochs(tmp_path) -> None:
    cfg = _cfg(tmp_path, "algorithm.adv_estimator=gae", "critic.enable=true", "trainer.total_training_steps=5",
               "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=2",
               "actor.ppo_epochs=2", "critic.ppo_epochs=1", "critic.ppo_micro_batch_size_per_gpu=2")
    p = plan_run(cfg, "cpu")
    assert p.critic is not None and (p.critic.mini_batches_per_step, p.critic.epochs) == (2, 1)
    assert p.critic.total_optimizer_steps == 5 * 2 * 1 and p.actor.total_optimizer_steps == 5 * 2 * 2
    assert plan_run(_cfg(tmp_path), "cpu").critic is None


def test_dynamic_sampling_draws_gen_batch_size_prompts(tmp_path) -> None:
    base = {"tb": "data.train_batch_size=4", "mb": "actor.ppo_mini_batch_size=4", "mc": "actor.ppo_micro_batch_size_per_gpu=4"}
    assert plan_run(_cfg(tmp_path, *base.values()), "cpu").gen_batch_size == 4  # filter off: train_batch_size
    on = _cfg(tmp_path, *base.values(), "data.gen_batch_size=6", "algorithm.filter_groups.enable=true",
               "algorithm.filter_groups.metric=score")
    assert plan_run(on, "cpu").gen_batch_size == 6


def test_samples_and_engine_counts_come_from_the_plan(tmp_path) -> None:
    """What the step (rollout.n), mrl plan (samples per step, engines) and Ray's size read: one derivation each."""
    from mrl.config.run_plan import ray_actors

    p = plan_run(_cfg(tmp_path, "rollout.n=4", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
                      "actor.ppo_micro_batch_size_per_gpu=4"), "cpu")
    assert (p.samples_per_prompt, p.samples_per_step, p.actor.mini_batch_size_samples) == (4, 32, 16)
    sep = _cfg(tmp_path, "cluster.n_gpus_per_node=4", "rollout.placement=separate", "rollout.num_engines=2",
               "rollout.weight_sync.transport=distributed")
    assert (plan_run(sep, "cpu").num_engines, plan_run(sep, "cpu").trainer_ranks, ray_actors(sep)) == (2, 2, (2, 2))
    colo = _cfg(tmp_path, "cluster.n_gpus_per_node=4", "cluster.device=cuda", "rollout.engine=sglang",
                "rollout.num_engines=null", "rollout.engine_tp_size=2",
                "rollout.weight_sync.transport=tensor")
    assert (plan_run(colo, "cpu").num_engines, ray_actors(colo)) == (2, (4, 0))  # colocated: one per engine_tp_size devices


def test_a_separate_reference_has_ranks_of_its_own(tmp_path) -> None:
    """ref.placement=separate: what build starts (the trainer group on the actor's devices, the reference's own
    group on its ref.num_devices) is what the layout (mrl plan) shows and what Ray is sized for."""
    from mrl.config.run_plan import ray_actors

    sep = _cfg(tmp_path, "cluster.n_gpus_per_node=4", "ref.placement=separate", "ref.num_devices=2",
               "ref.megatron.tensor_model_parallel_size=2")
    p = plan_run(sep, "cpu")
    assert (p.trainer_ranks, p.ref_ranks, ray_actors(sep)) == (2, 2, (4, 0))
    ref = p.layout["ref"]
    assert (ref.first, ref.count, ref.colocated, ref.parallel.tensor_model_parallel_size) == (2, 2, False, 2)
    colo = plan_run(_cfg(tmp_path, "cluster.n_gpus_per_node=4"), "cpu")
    assert (colo.trainer_ranks, colo.ref_ranks, colo.layout["ref"].colocated) == (4, 0, True)


def test_the_plan_is_frozen_and_needs_a_resolved_device(tmp_path) -> None:
    p = plan_run(_cfg(tmp_path), "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.device = "cuda"  # type: ignore[misc]
    with pytest.raises(ValueError, match="resolved device"):
        plan_run(_cfg(tmp_path), "auto")


@pytest.mark.parametrize(("overrides", "blocker"), [
    (["actor.ppo_epochs=2"], "actor.ppo_epochs=2"),
    (["actor.ppo_mini_batch_size=16"], "= 2 mini-batches"),
    (["algorithm.use_kl_in_reward=true", "algorithm.allow_double_kl=true"], "algorithm.use_kl_in_reward"),
    (["algorithm.repr_align.enable=true", "algorithm.repr_align.ref_alignment.enable=true"], "algorithm.repr_align"),
    (["trainer.async_training.max_staleness=1", "rollout.placement=separate", "rollout.num_engines=1",
      "rollout.weight_sync.transport=distributed"], "max_staleness=1"),
    (["algorithm.rollout_correction.rollout_is=token"], "algorithm.rollout_correction"),
])
def test_the_on_policy_shortcut_applies_only_to_one_step_from_pi_old(tmp_path, overrides, blocker) -> None:
    from mrl.config.loader import ConfigError
    from mrl.config.run_plan import on_policy_blockers

    assert plan_run(_cfg(tmp_path), "cpu").on_policy_shortcut  # the quickstart: one step per batch, null = auto
    assert not plan_run(_cfg(tmp_path, "actor.on_policy_shortcut=false"), "cpu").on_policy_shortcut
    cfg = _cfg(tmp_path, *overrides)
    assert any(blocker in b for b in on_policy_blockers(cfg)), on_policy_blockers(cfg)
    assert not plan_run(cfg, "cpu").on_policy_shortcut  # null: silently the recomputing path, the plan says so
    with pytest.raises(ConfigError) as e:  # true: refused at load / `mrl plan` time, naming why
        _cfg(tmp_path, *overrides, "actor.on_policy_shortcut=true")
    assert "actor.on_policy_shortcut=true" in str(e.value) and blocker in str(e.value) and "fix:" in str(e.value)


def test_the_step_phases_are_decided_once_from_the_config(tmp_path) -> None:
    p = plan_run(_cfg(tmp_path), "cpu").phases  # the quickstart: GRPO with a KL loss
    assert p.ref and not (p.values or p.teacher or p.distill_reward or p.remax_baseline or p.filter_groups
                          or p.shape_rewards or p.agent or p.dump_rollout)
    ppo = plan_run(_cfg(tmp_path, "algorithm.adv_estimator=gae", "actor.use_kl_loss=false", "critic.ppo_micro_batch_size_per_gpu=8",
                        f"trainer.rollout_data_dir={tmp_path}/dump"), "cpu").phases
    assert ppo.values and ppo.dump_rollout and not ppo.ref
    (tmp_path / "teacher").mkdir()
    d = plan_run(_cfg(tmp_path, "algorithm.distill.mode=kl_loss", "teacher.enable=true",
                      f"teacher.path={tmp_path}/teacher", "algorithm.adv_estimator=remax", "actor.use_kl_loss=false"),
                 "cpu").phases
    assert d.teacher and d.distill_reward and d.remax_baseline and not d.ref
