"""The trainer's prompt sampler follows data.shuffle and data.seed (issue 19: it used trainer.seed
and always shuffled)."""
from __future__ import annotations

from types import SimpleNamespace

from mrl.config import load_config
from mrl.config.run_plan import plan_run
from mrl.data.sampler import sampler_for
from mrl.driver.trainer import RLTrainer
from mrl.rewards.manager import RewardManager


def _sampler(tmp_path, *overrides: str):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "t.jsonl").write_text("")
    cfg = load_config("mrl_configs/quickstart.yaml", [
        f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]", "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4", *overrides])
    plan = plan_run(cfg, "cpu", batches_per_epoch=10)
    services = SimpleNamespace(train_ds=list(range(40)), pad_token_id=0, reward=RewardManager(lambda *a, **k: 0.0),
                               sampler=sampler_for(cfg.data, plan.gen_batch_size, list(range(40))),  # as build makes it
                               workers=None, rm_workers=None, teacher_workers=None, ref_workers=None, pool=SimpleNamespace(asleep=False), client=None, log_dir=tmp_path,
                               plan=plan, judge=None)
    s = RLTrainer(cfg, services).sampler
    return [s.next_batch() for _ in range(3)]


def test_shuffle_false_keeps_file_order(tmp_path) -> None:
    assert _sampler(tmp_path, "data.shuffle=false") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_data_seed_not_trainer_seed_orders_the_prompts(tmp_path) -> None:
    a = _sampler(tmp_path, "data.seed=5", "trainer.seed=1")
    assert a == _sampler(tmp_path, "data.seed=5", "trainer.seed=2")
    assert a != _sampler(tmp_path, "data.seed=6", "trainer.seed=1")
    assert a != [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
