"""The driver's typed proxies mirror their rank classes (the trainer's, a separate side model's: reward model,
teacher): same method names, same parameters."""
from __future__ import annotations

import inspect

import pytest

from mrl.driver.ranks import TrainRanks
from mrl.driver.side_ranks import SideModelRanks, side_model
from mrl.workers.rank import TrainRank
from mrl.workers.side_rank import SideModelRank


def _public(cls) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(cls).items()
            if callable(f) and not n.startswith("_")}


def test_every_proxy_method_is_a_rank_method_with_the_same_parameters():
    rank, proxy = _public(TrainRank), _public(TrainRanks)
    assert set(proxy) <= set(rank), f"proxy methods with no TrainRank method: {sorted(set(proxy) - set(rank))}"
    for name, sig in proxy.items():
        want = [(p.name, p.kind, p.default, str(p.annotation)) for p in rank[name].parameters.values()]
        got = [(p.name, p.kind, p.default, str(p.annotation)) for p in sig.parameters.values()]
        assert got == want, f"TrainRanks.{name}{sig} != TrainRank.{name}{rank[name]}"


def test_the_driver_reaches_every_rank_phase_through_the_proxy():
    """Everything the driver calls on ranks besides construction and teardown is typed."""
    internal = {"before_call", "close"}
    assert set(_public(TrainRank)) - internal == set(_public(TrainRanks))


class _TaggedGroup:
    """A rank group whose every rank answers its tag (rank 0's answer is the tag); records the methods called."""

    def __init__(self, tag):
        self.tag, self.calls, self.args = tag, [], []

    def execute_all(self, method, *args, **kwargs):
        self.calls.append(method)
        self.args.append((args, kwargs))
        return [self.tag, "other rank"]


def test_a_separate_side_models_proxy_mirrors_its_rank():
    rank, proxy = _public(SideModelRank), _public(SideModelRanks)
    assert set(rank) - {"before_call", "close"} == set(proxy)
    for name, sig in proxy.items():
        want = [(p.name, p.kind, p.default, str(p.annotation)) for p in rank[name].parameters.values()]
        got = [(p.name, p.kind, p.default, str(p.annotation)) for p in sig.parameters.values()]
        assert got == want, f"SideModelRanks.{name}{sig} != SideModelRank.{name}{rank[name]}"
    # the phase makes the same call on either placement
    assert str(inspect.signature(TrainRanks.compute_side)) == str(inspect.signature(SideModelRanks.compute_side))


@pytest.mark.parametrize("role", ["reward_model", "teacher"])
def test_a_side_model_routes_by_placement(role):
    trainer, group = _TaggedGroup("trainer"), _TaggedGroup("group")
    ranks = TrainRanks(trainer)
    colocated = side_model(role, None, ranks)  # colocated: the trainer ranks hold the model
    assert colocated("batch") == "trainer" and trainer.calls == ["compute_side"] and colocated.fallbacks() == []
    assert side_model(role, group, ranks)("batch") == "group"
    assert group.calls == ["compute_side"] and trainer.calls == ["compute_side"]
    assert trainer.args[-1] == group.args[-1] == ((role, "batch"), {})  # the role travels with the batch


def test_calls_reach_the_group_by_the_rank_method_name():
    calls = []

    class Group:
        def execute_all(self, method, *args, **kwargs):
            calls.append((method, args, kwargs))
            return [{"rank": 0}, {"rank": 1}]

    ranks = TrainRanks(Group())
    assert ranks.update_policy("batch") == {"rank": 0}  # rank 0's answer
    assert ranks.sync_weights(3) == [{"rank": 0}, {"rank": 1}]  # every rank's report
    ranks.init_weight_sync(["http://e"], token="t")
    assert calls == [("update_policy", ("batch",), {}), ("sync_weights", (3,), {"pause": True}),
                     ("init_weight_sync", (["http://e"],), {"token": "t", "routable": False})]


def test_rollout_controller_refuses_stale_or_failed_samples():
    """A sync that missed an engine must not let its samples train silently."""
    from types import SimpleNamespace

    import pytest

    from mrl.driver.rollout_controller import RolloutController

    def result(versions, failed=()):
        return SimpleNamespace(failed=list(failed), samples=[None] * 4, weight_versions=set(versions))

    answers = iter([result({"3"}), result({"3", "2"}), result({"default"}), result({"3"}, failed=[
        SimpleNamespace(error="boom")])])
    pool = SimpleNamespace(engines=[], lost_engines=list)  # every engine in service
    ctl = RolloutController(pool=pool, client=SimpleNamespace(generate=lambda req: next(answers)), ranks=None,
                            startup_timeout_s=1.0, log_dir="/logs")
    assert ctl.generate(None, 3)[1] == 3
    with pytest.raises(RuntimeError, match=r"weight versions .* expected 3"):
        ctl.generate(None, 3)
    assert ctl.generate(None, 0)[1] == 0  # the start weights report "default"
    with pytest.raises(RuntimeError, match="1 of 4 rollout samples failed, first: boom; see the engine logs under /logs"):
        ctl.generate(None, 3)
