"""RolloutController against two embedded engines, one of which is SIGKILLed: between a generation and
the next weight push (the push finds it gone, the pool restarts it, the push re-syncs it, and it serves the
pushed weights, checksums equal to what was sent) and during a push (the run stops naming the engine, not
with the sender's connection error). The trainer side is the real weight sender (``WeightSyncer``,
tensor transport) as one in-process rank."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from mrl.driver.ranks import TrainRanks
from mrl.driver.rollout_controller import RolloutController
from mrl.errors import RunStoppedError
from mrl.rollout.client import RolloutClient
from mrl.rollout.pool import EngineEndpoint, EnginePool
from mrl.rollout.router import Router
from mrl.rollout.sglang_launcher import EngineProcess, build_embedded_command
from mrl.rollout.types import RolloutRequest
from mrl.rollout.weight_sync import WeightSyncer
from tests.helpers.dist import free_port
from tests.helpers.tiny_models import build_tiny_model, make_tiny_hf

pytestmark = pytest.mark.slow

TOKEN = "per-run-test-token"
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20], [30, 31]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    d = make_tiny_hf(tmp_path_factory.mktemp("model"), "qwen2")
    procs = []
    for i in range(2):
        port = free_port()
        p = EngineProcess(build_embedded_command(str(d), port, token_env="MRL_TEST_TOKEN"), f"http://127.0.0.1:{port}",
                          tmp_path_factory.getbasetemp() / f"engine{i}.log", env={"MRL_TEST_TOKEN": TOKEN},
                          startup_timeout_s=180)
        p.start(wait=False)
        procs.append(p)
    try:
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            p.stop()


class SenderRank:
    """One trainer rank's weight sender, in this process: ``sync_weights(version)`` pushes ``weights(version)``
    (``before_push`` runs first: where a test injects its fault)."""

    def __init__(self, urls: list[str], weights: Callable[[int], list[tuple[str, torch.Tensor]]]) -> None:
        self.syncer = WeightSyncer("tensor", urls, verify=True, barrier=lambda: None, bucket_mb=0.1, token=TOKEN)
        self.weights = weights
        self.before_push: Callable[[], None] = lambda: None

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        if method == "rejoin_weight_sync":
            return [self.syncer.rejoin()]
        assert method == "sync_weights", method
        self.before_push()
        version = args[0]
        return [self.syncer.sync(self.weights(version), version, pause=kwargs.get("pause", True)).metrics()]


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in build_tiny_model("qwen2", seed=100 + version).named_parameters()]


def _checksums(url: str) -> dict[str, str]:
    r = httpx.post(url + "/weights_checksum", json={}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60,
                   trust_env=False)
    r.raise_for_status()
    return r.json()["checksums"]


@pytest.fixture
def controller(engines, tmp_path: Path):
    pool = EnginePool([EngineEndpoint(p.url, p.restart) for p in engines], token=TOKEN, health_interval_s=0,
                      restart_timeout_s=180)
    rank = SenderRank([p.url for p in engines], _weights)
    c = RolloutController(pool, RolloutClient(Router(pool)), TrainRanks(rank), startup_timeout_s=180, log_dir=tmp_path)
    yield c, rank
    pool.wait_recovered(240)  # a killed engine is back before the next test (the engines are shared)
    rank.syncer.close()
    pool.close()


def _generate(c: RolloutController, version: int) -> set[str | None]:
    res, _ = c.generate(RolloutRequest(PROMPTS, n=2, sampling_params={"max_new_tokens": 4}), version)
    assert not res.failed
    return res.weight_versions


def test_an_engine_killed_between_steps_is_restarted_and_gets_the_pushed_weights(controller, engines) -> None:
    c, _ = controller
    c.push(1, {})
    assert _generate(c, 1) == {"1"}
    engines[0].kill()  # after the rollout, before the next push
    m: dict[str, float] = {}
    c.push(2, m)  # finds it gone, restarts it and includes it: the sender verifies every engine's checksums
    victim = c.pool.engines[0]
    assert victim.healthy and victim.restarts == 1 and m["weight_sync/num_tensors"] > 0, victim.last_error
    assert c.pool.loop.run(c.pool.get_weight_version(victim)) == "2"
    assert _checksums(engines[0].url) == _checksums(engines[1].url)  # the same (pushed) weights in both
    assert _generate(c, 2) == {"2"}


def test_an_engine_killed_during_a_push_stops_the_run_naming_it(controller, engines) -> None:
    c, rank = controller
    c.push(1, {})
    rank.before_push = engines[1].kill  # the push starts against a dead engine: the sender fails part-way
    with pytest.raises(RunStoppedError, match=rf"engine 1 \({engines[1].url}\) died during the weight push of "
                                              r"version 2: a push cannot be resumed half-way") as e:
        c.push(2, {})
    assert e.value.resume_hint
    rank.before_push = lambda: None
