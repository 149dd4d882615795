"""The driver refuses, by key, what it cannot run yet, and names the quickstart fix for missing assets."""
from __future__ import annotations

import pytest

from mrl.config import load_config
from mrl.driver.build import check_supported
from mrl.errors import UnsupportedConfigError


def _cfg(tmp_path, *overrides: str):
    (tmp_path / "m").mkdir()
    (tmp_path / "t.jsonl").write_text("")
    return load_config("mrl_configs/quickstart.yaml", [f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]",
                                                       *overrides])


def test_quickstart_is_supported(tmp_path) -> None:
    check_supported(_cfg(tmp_path))


def test_seed_003_reward_shaping_is_supported(tmp_path) -> None:
    # ref_reward_blend and repr_align run in the driver (mrl/driver/shaping.py); no longer refused
    check_supported(_cfg(tmp_path, "algorithm.ref_reward_blend.enable=true", "algorithm.repr_align.enable=true"))


def test_ppo_quickstart_is_supported(tmp_path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "t.jsonl").write_text("")
    cfg = load_config("mrl_configs/quickstart_ppo.yaml", [f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]"])
    assert cfg.critic_enabled and cfg.algorithm.adv_estimator == "gae"
    check_supported(cfg)


@pytest.mark.parametrize("override, key", [
    ("critic.enable=true critic.ppo_micro_batch_size_per_gpu=4 critic.megatron.pipeline_model_parallel_size=2",
     r"critic.megatron.pipeline_model_parallel_size=2 \(actor 1\).*set critic.megatron.<key> equal to actor.megatron.<key>"),
    ("algorithm.adv_estimator=gae critic.ppo_micro_batch_size_per_gpu=4 critic.placement=separate critic.num_devices=2 cluster.n_gpus_per_node=4",
     "critic.placement=separate"),
])
def test_unsupported_keys_are_named(tmp_path, override: str, key: str) -> None:
    with pytest.raises(UnsupportedConfigError, match=key):
        check_supported(_cfg(tmp_path, *override.split()))


def test_missing_model_names_the_quickstart_fix(tmp_path) -> None:
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tmp_path}/nope"])
    with pytest.raises(UnsupportedConfigError, match="model.path=.*mrl.quickstart"):
        check_supported(cfg)


def test_sglang_engines_separate_placement_and_sglang_router_are_supported(tmp_path) -> None:
    # The driver launches them (mrl/driver/engines.py); config validation still refuses SGLang on CPU.
    (tmp_path / "m").mkdir()
    (tmp_path / "t.jsonl").write_text("")
    base = [f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]"]
    check_supported(load_config("mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml", base))
    check_supported(load_config("mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml", [
        *base, "rollout.placement=separate", "rollout.num_engines=2", "cluster.n_gpus_per_node=10"]))
    check_supported(load_config("mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml", [*base, "rollout.router=sglang_router"]))
