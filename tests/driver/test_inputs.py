"""``mrl train`` refuses to start without the files the run reads, naming the key and the quickstart fix;
every other rule is config validation (tests/config/test_validation.py), checked when the config loads."""
from __future__ import annotations

import pytest

from mrl.config import load_config
from mrl.config.validate import check_config
from mrl.driver.build import check_inputs
from mrl.errors import UnsupportedConfigError


def _base(tmp_path) -> list[str]:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "t.jsonl").write_text("")
    return [f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]"]


@pytest.mark.parametrize("recipe, extra", [
    ("mrl_configs/quickstart.yaml", []),
    ("mrl_configs/quickstart.yaml", ["algorithm.ref_reward_blend.enable=true", "algorithm.repr_align.enable=true"]),
    ("mrl_configs/quickstart_ppo.yaml", []),
    ("mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml", []),
    ("mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml", ["rollout.placement=separate", "rollout.num_engines=2",
                                                "cluster.n_gpus_per_node=10", "rollout.weight_sync.transport=distributed"]),
    ("mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml", ["rollout.router=sglang_router"]),
])
def test_valid_recipes_with_their_files_start(tmp_path, recipe: str, extra: list[str]) -> None:
    check_inputs(load_config(recipe, [*_base(tmp_path), *extra]))


def test_missing_model_names_the_quickstart_fix(tmp_path) -> None:
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tmp_path}/nope"])
    with pytest.raises(UnsupportedConfigError, match="model.path=.*mrl.quickstarts.base"):
        check_inputs(cfg)


def test_missing_train_file_is_named_and_only_a_plan_note(tmp_path) -> None:
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tmp_path}", f"data.train_files=[{tmp_path}/gone.jsonl]"])
    with pytest.raises(UnsupportedConfigError, match=r"data.train_files=.*gone.jsonl"):
        check_inputs(cfg)
    errors, notes = check_config(cfg)
    assert not errors and any("gone.jsonl" in n for n in notes)  # `mrl plan` may run before the data exists
