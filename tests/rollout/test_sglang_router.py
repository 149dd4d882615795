"""SGLang's own router (the sglang_router package, no GPU needed) in front of two embedded engines:
batch requests through it, and an engine restart that takes it out of the router until it serves
the current weights again."""
from __future__ import annotations

import time

import httpx
import pytest

from mrl.rollout.client import RolloutClient
from mrl.rollout.pool import EngineEndpoint, EnginePool
from mrl.rollout.router import Router
from mrl.rollout.sglang_launcher import (
    EngineLaunchError,
    EngineProcess,
    build_embedded_command,
)
from mrl.rollout.sglang_router import SGLangRouter
from mrl.rollout.types import RolloutRequest
from tests.helpers.e2e import free_port_pair
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [30, 31], [40, 41, 42, 43], [50, 51, 52], [60] * 6, [70, 71]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = make_tiny_hf(tmp_path_factory.mktemp("model"), "qwen2")
    port = free_port_pair()
    logs = tmp_path_factory.getbasetemp()
    engines = [EngineProcess(build_embedded_command(str(d), port + i), f"http://127.0.0.1:{port + i}",
                             logs / f"engine{i}.log", startup_timeout_s=180) for i in range(2)]
    router = None
    try:
        for e in engines:
            e.start(wait=False)
        for e in engines:
            e.wait_healthy()
        router = _start_router([e.url for e in engines], logs)
        yield engines, router
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


def _start_router(urls: list[str], logs) -> SGLangRouter:
    """The router on a free port. A port free when drawn can be bound by another test's server before the router
    binds it (seen once in `make test`: "Address already in use" on the router's port): then a new port, at most
    3 tries; any other failure raises at once."""
    for attempt in range(3):
        router = SGLangRouter(urls, free_port_pair(), logs / f"router{attempt}.log")
        try:
            router.start()
            return router
        except EngineLaunchError as e:
            router.stop()
            if "Address already in use" not in str(e) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _submitted(url: str) -> int:
    return httpx.get(url + "/get_server_info", timeout=30, trust_env=False).json()["stats"].get("submitted", 0)


def _routed(router: SGLangRouter) -> set[str]:
    return {w["url"].rstrip("/") for w in router.workers() if w.get("is_healthy", True)}


def test_batches_go_through_sglang_router_to_both_engines(setup):
    engines, router = setup
    before = [_submitted(e.url) for e in engines]
    pool = EnginePool([EngineEndpoint(router.url, restart=router.restart)], health_interval_s=0)
    try:
        res = RolloutClient(Router(pool), prompts_per_request=1).generate(  # as the driver builds it
            RolloutRequest(PROMPTS, n=4, sampling_params={"max_new_tokens": 6, "temperature": 1.0}))
    finally:
        pool.close()
    assert len(res.samples) == 32 and not res.failed, [s.error for s in res.failed][:2]
    assert all(1 <= s.response_length <= 6 and len(s.rollout_log_probs) == s.response_length for s in res.samples)
    assert res.weight_versions == {"default"}
    got = [_submitted(e.url) - b for e, b in zip(engines, before)]
    assert sum(got) == 32 and all(g > 0 for g in got), got  # the router spread the 8 batches over both engines


def test_restarted_engine_leaves_the_router_until_it_is_back(setup):
    engines, router = setup
    assert _routed(router) == {e.url for e in engines}
    seen: list[tuple[str, bool, frozenset]] = []

    def hook(url: str, serving: bool) -> None:
        router.on_engine_service(url, serving)
        deadline = time.monotonic() + 60  # the router applies worker changes in the background
        while (url in _routed(router)) != serving and time.monotonic() < deadline:
            time.sleep(0.1)
        seen.append((url, serving, frozenset(_routed(router))))

    pool = EnginePool([EngineEndpoint(e.url, restart=e.restart) for e in engines], health_interval_s=0,
                      restart_timeout_s=180)
    pool.on_service_change = hook
    try:
        engines[1].kill()
        assert pool.loop.run(pool.check_health())[engines[1].url] is False
        pool.wait_recovered(180)
        assert pool.engines[1].healthy and pool.engines[1].restarts == 1
    finally:
        pool.close()
    u0, u1 = engines[0].url, engines[1].url
    assert seen == [(u1, False, frozenset({u0})), (u1, True, frozenset({u0, u1}))]
    route = EnginePool([EngineEndpoint(router.url)], health_interval_s=0)
    try:
        res = RolloutClient(Router(route)).generate(RolloutRequest(PROMPTS, n=2, sampling_params={"max_new_tokens": 3}))
    finally:
        route.close()
    assert not res.failed


def test_seeded_samples_through_sglang_router_equal_direct_ones(setup):
    """sglang-router's /generate takes one sampling_params map, so seeded samples travel one per
    request there (params_list_in_batch=False); the draws equal those of one seeded batch sent to an
    engine directly (the trainer's per-sample seeds, reproducible whatever the route)."""
    engines, router = setup
    seeds = [[7000 + 10 * i + j for j in range(3)] for i in range(len(PROMPTS))]
    req = RolloutRequest(PROMPTS, n=3, sampling_params={"max_new_tokens": 6, "temperature": 1.0}, sampling_seeds=seeds)
    out = {}
    for name, url, batch in (("router", router.url, False), ("engine", engines[0].url, True)):
        pool = EnginePool([EngineEndpoint(url)], health_interval_s=0)
        try:
            out[name] = RolloutClient(Router(pool), params_list_in_batch=batch).generate(req)
        finally:
            pool.close()
        assert not out[name].failed, [s.error for s in out[name].failed][:2]
    assert [s.response_ids for s in out["router"].samples] == [s.response_ids for s in out["engine"].samples]
    assert len({tuple(s.response_ids) for s in out["engine"].samples}) > len(PROMPTS)  # seeds differ per sample
