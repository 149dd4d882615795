"""The ``auto`` settings (mrl/config/auto.py): what the run plan resolves them to, and why, per device."""
from __future__ import annotations

import pytest

from mrl.config import load_config
from mrl.config.auto import resolve_shared_prefix, resolve_transport
from mrl.config.plan_report import plan_text
from mrl.config.run_plan import plan_run

RECIPE = "mrl_configs/quickstart.yaml"


def _cfg(tmp_path, *overrides: str):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "t.jsonl").write_text("")
    return load_config(RECIPE, [f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]", *overrides])


def test_the_defaults_are_auto(tmp_path) -> None:
    cfg = _cfg(tmp_path)
    assert cfg.rollout.weight_sync.transport == "auto" and cfg.actor.shared_prefix == "auto"


@pytest.mark.parametrize("device, overrides, want, why", [
    ("cpu", [], "inprocess", "no protocol"),
    ("cpu", ["actor.megatron.tensor_model_parallel_size=2"], "tensor", "actor TP=2"),
    ("cpu", ["rollout.router=sglang_router"], "tensor", "rollout.router=sglang_router"),
    ("cpu", ["trainer.async_training.max_staleness=1"], "tensor", "max_staleness=1"),
    ("cpu", ["rollout.placement=separate", "rollout.num_engines=1", "cluster.n_gpus_per_node=3"], "distributed",
     "separate engines"),
    ("cuda", [], "tensor", "CUDA IPC"),
    ("cuda", ["cluster.nnodes=2", "rollout.host=0.0.0.0"], "disk", "cluster.nnodes=2"),
    ("cpu", ["rollout.weight_sync.transport=distributed"], "distributed", "set in the config"),
])
def test_transport_auto_picks_the_fastest_valid_one(tmp_path, device, overrides, want, why) -> None:
    cfg = _cfg(tmp_path, *overrides)
    choice = resolve_transport(cfg, device)
    assert choice.value == want and why in choice.why, choice
    plan = plan_run(cfg, device)
    assert plan.transport == want and choice in plan.choices


def test_the_chosen_transport_passes_the_configs_own_rules(tmp_path) -> None:
    """What auto picks on CPU is accepted when written explicitly (check_config runs in load_config)."""
    for overrides in ([], ["actor.megatron.tensor_model_parallel_size=2"]):
        cfg = _cfg(tmp_path, *overrides)
        _cfg(tmp_path, *overrides, f"rollout.weight_sync.transport={resolve_transport(cfg, 'cpu').value}")


@pytest.mark.parametrize("device, overrides, want, why", [
    # the measured cases (docs/vs_trl.md): quickstart (P 64, R 8), vs_trl tiny (P 16, R 4) on; compute (R 64) off
    ("cpu", [], True, "rows of <= 176 tokens"),
    ("cpu", ["data.max_prompt_length=16", "rollout.max_response_length=4"], True, "on"),
    ("cpu", ["data.max_prompt_length=16", "rollout.max_response_length=64"], False, "answers longer than prompts"),
    ("cpu", ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus", "actor.ppo_micro_batch_size_per_gpu=16"],
     False, "rollout.n=1"),
    ("cpu", ["data.max_prompt_length=256", "rollout.max_response_length=64"], False, "P + n(R-1) = 1264 > 512"),
    ("cuda", [], False, "off on cuda"),
    ("cpu", ["actor.shared_prefix=false"], False, "set in the config"),
    ("cpu", ["actor.shared_prefix=true", "rollout.max_response_length=128"], True, "set in the config"),
])
def test_shared_prefix_auto_follows_the_measured_rule(tmp_path, device, overrides, want, why) -> None:
    cfg = _cfg(tmp_path, *overrides)
    choice = resolve_shared_prefix(cfg, device)
    assert choice.value is want and why in choice.why, choice
    assert plan_run(cfg, device).shared_prefix is want


def test_mrl_plan_prints_what_auto_chose_and_why(tmp_path) -> None:
    text = plan_text(_cfg(tmp_path, "cluster.device=cpu"))
    assert "chosen for cluster.device=cpu:" in text
    assert "rollout.weight_sync.transport=inprocess: auto: CPU" in text
    assert "actor.shared_prefix=true: auto: on" in text
    assert "inside the trainer ranks (weight_sync.transport=inprocess" in text


def test_push_with_update_follows_the_resolved_transport(tmp_path) -> None:
    assert plan_run(_cfg(tmp_path), "cpu").push_with_update  # auto -> inprocess with the on-policy shortcut
    assert not plan_run(_cfg(tmp_path, "rollout.weight_sync.transport=tensor"), "cpu").push_with_update


@pytest.mark.parametrize("device, te, lora, want, why", [
    ("cpu", False, False, "sdpa", "auto: cpu"),
    ("cpu", True, False, "sdpa", "auto: cpu"),  # TE installed but no CUDA: its kernels cannot run
    ("cuda", False, False, "sdpa", "not importable"),
    ("cuda", True, False, "te", "Transformer Engine on CUDA"),
    ("cuda", True, True, "sdpa", "LoRA"),
])
def test_attention_backend_auto_is_te_only_where_it_runs(device, te, lora, want, why) -> None:
    from mrl.config.auto import choose_attention_backend

    choice = choose_attention_backend("auto", device=device, te_importable=te, lora=lora)
    assert choice.value == want and why in choice.why, choice
    assert choose_attention_backend("local", device=device, te_importable=te, lora=lora).value == "local"


@pytest.mark.parametrize("overrides, want, why", [
    ([], False, "actor.shared_prefix is on"),  # quickstart: shared rows win on CPU (measured)
    (["actor.shared_prefix=false"], True, "auto: on"),
    (["actor.shared_prefix=false", "actor.megatron.attention_backend=local"], False,
     "actor.megatron.attention_backend=local"),
    (["actor.shared_prefix=false", "ref.megatron.attention_backend=local"], False, "ref.megatron.attention_backend"),
    (["actor.use_remove_padding=true"], True, "set in the config"),  # and shared_prefix auto steps aside
])
def test_remove_padding_auto_packs_when_every_role_runs_sdpa(tmp_path, overrides, want, why) -> None:
    plan = plan_run(_cfg(tmp_path, *overrides), "cpu")
    choice = plan.choices[-1]
    assert choice.key == "actor.use_remove_padding" and choice.value is want and why in choice.why, choice
    assert plan.remove_padding is want
    assert not (plan.remove_padding and plan.shared_prefix)
    assert plan.attention_backend("actor") in ("sdpa", "local")


def test_mrl_plan_prints_the_attention_backend_of_every_role_and_the_packing(tmp_path) -> None:
    text = plan_text(_cfg(tmp_path, "cluster.device=cpu"))
    assert "actor.megatron.attention_backend=sdpa: auto: cpu" in text
    assert "ref.megatron.attention_backend=sdpa: auto: cpu" in text  # the quickstart's KL loss builds a reference
    assert "critic.megatron.attention_backend" not in text  # GRPO builds no critic
    assert "actor.use_remove_padding=false: auto: off, actor.shared_prefix is on" in text


@pytest.mark.parametrize("overrides, key", [
    (["actor.megatron.attention_backend=te"], "actor.megatron.attention_backend=te: Transformer Engine runs on CUDA"),
    (["actor.use_remove_padding=true", "actor.megatron.attention_backend=local"],
     ("actor.use_remove_padding=true needs every packing role on the sdpa attention backend, but "
      "actor.megatron.attention_backend resolves to local")),
    (["actor.use_remove_padding=true", "actor.shared_prefix=true"],
     "actor.use_remove_padding=true with actor.shared_prefix=true"),
])
def test_settings_that_cannot_run_are_refused_before_anything_starts(tmp_path, overrides, key) -> None:
    from mrl.config.validate import check_config

    cfg = _cfg(tmp_path, "cluster.device=cpu")
    cfg = cfg.model_copy(deep=True)
    for o in overrides:  # past load_config, which would raise on the first error
        dotted, value = o.split("=")
        section, *mid, leaf = dotted.split(".")
        obj = getattr(cfg, section)
        for m in mid:
            obj = getattr(obj, m)
        setattr(obj, leaf, {"true": True, "false": False}.get(value, value))
    errors, _ = check_config(cfg)
    assert any(key in e for e in errors), errors


def test_only_the_roles_that_pack_decide_the_packing(tmp_path) -> None:
    """The reward model scores compact rows: its backend does not turn packing off; the reference's does."""
    from mrl.config.auto import AutoChoice, resolve_remove_padding

    cfg = _cfg(tmp_path, "actor.shared_prefix=false")
    off = AutoChoice("actor.shared_prefix", False, "set in the config")
    actor = AutoChoice("actor.megatron.attention_backend", "sdpa", "auto")
    rm = AutoChoice("reward_model.megatron.attention_backend", "local", "set in the config")
    ref = AutoChoice("ref.megatron.attention_backend", "local", "set in the config")
    assert resolve_remove_padding(cfg, "cpu", off, [actor, rm]).value is True
    assert resolve_remove_padding(cfg, "cpu", off, [actor, ref]).value is False
