"""``build``'s teardown stops exactly what started, in the reverse order of starting, whether the run body
raised or a stage failed half-way: each part is registered the moment it starts (an ExitStack), so no
part is reached through a half-filled object. The stages are replaced by recording ones here; the real
stages run in every end-to-end test (tests/driver/*_e2e.py)."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from mrl.config import load_config
from mrl.driver import build as build_mod

READ = "read inputs, 32 prompts per round"  # the quickstart's data.train_batch_size (no dynamic sampling)
PLAN = "plan on cpu, 3 batches per epoch"  # once, after Ray: every stage after it takes this plan


@pytest.fixture
def staged(monkeypatch, tmp_path):
    events: list[str] = []
    cfg = load_config("mrl_configs/quickstart.yaml", [f"trainer.default_local_dir={tmp_path}/ck",
                                                      "trainer.total_training_steps=null", "trainer.total_epochs=2"])

    def part(name: str):
        return SimpleNamespace(close=lambda *a, **k: events.append(f"close {name}"))

    inputs = SimpleNamespace(reward=part("reward"), tokenizer=None, pad_token_id=0, train_ds=[], val_ds=None,
                             rm_inputs=None, pictures=None, agent_tools=None, sampler=SimpleNamespace(batches_per_epoch=3),
                             resumed_from=None, log_dir=tmp_path)

    def read_inputs(cfg, gen_batch: int):
        events.append(f"read inputs, {gen_batch} prompts per round")
        return inputs

    def start_ray(cfg, stack: contextlib.ExitStack, stop) -> str:
        events.append("start ray")
        stack.callback(events.append, "stop ray")
        return "cpu"

    real_plan_run = build_mod.plan_run

    def plan_run(cfg, device, batches_per_epoch=None):
        events.append(f"plan on {device}, {batches_per_epoch} batches per epoch")
        return real_plan_run(cfg, device, batches_per_epoch)

    def start_ranks(cfg, plan, stack, stop):
        events.append("start ranks")
        stack.callback(events.append, "close ranks")
        events.append("start engines")
        stack.callback(events.append, "stop engines")
        return "workers", (None, None, None), SimpleNamespace(urls=[], token="t", remote_nodes=False)

    monkeypatch.setattr(build_mod, "check_inputs", lambda cfg: None)
    monkeypatch.setattr(build_mod, "read_inputs", read_inputs)
    monkeypatch.setattr(build_mod, "_start_ray", start_ray)
    monkeypatch.setattr(build_mod, "plan_run", plan_run)
    monkeypatch.setattr(build_mod, "_start_ranks_and_engines", start_ranks)
    monkeypatch.setattr("mrl.driver.judge.start_judge", lambda *a: None)
    monkeypatch.setattr(build_mod.TrainRanks, "init_weight_sync", lambda self, *a, **k: events.append("sync group"))
    return cfg, events, part


def test_a_failing_stage_stops_what_started_in_reverse_order(staged, monkeypatch) -> None:
    cfg, events, _ = staged

    def start_rollout(*a):
        raise RuntimeError("router would not start")

    monkeypatch.setattr(build_mod, "_start_rollout", start_rollout)
    with pytest.raises(RuntimeError, match="router would not start"), build_mod.build(cfg):
        pytest.fail("the body must not run when a stage failed")
    assert events == [READ, "start ray", PLAN, "start ranks", "start engines",
                      "stop engines", "close ranks", "stop ray", "close reward"]


@pytest.mark.parametrize("body_raises", [False, True])
def test_services_are_complete_and_tracking_finishes_with_the_run_status(staged, monkeypatch, body_raises) -> None:
    cfg, events, part = staged
    finished: list[str] = []
    monkeypatch.setattr(build_mod, "_start_rollout", lambda cfg, plan, engines, inputs, stack: (
        build_mod._start(stack, "pool", part("pool")), "client"))
    monkeypatch.setattr("mrl.observability.tracking.Tracking.from_config",
                        lambda *a, **k: SimpleNamespace(finish=finished.append))
    with contextlib.suppress(ValueError), build_mod.build(cfg) as s:
        assert s.workers == "workers" and s.client == "client" and s.plan.device == "cpu"
        # the one plan: Ray's device and the run length from the sampler's batches per epoch
        assert s.plan.total_steps == 2 * 3 and s.plan.actor.total_optimizer_steps == 2 * 3
        with pytest.raises(AttributeError):  # frozen: nothing is filled in later
            s.judge = object()
        if body_raises:
            raise ValueError("step failed")
    assert finished == ["FAILED" if body_raises else "FINISHED"]
    assert events == [READ, "start ray", PLAN, "start ranks", "start engines", "sync group",
                      "close pool", "stop engines", "close ranks", "stop ray", "close reward"]
