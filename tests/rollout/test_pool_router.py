"""Two embedded engines behind the built-in router: batch shapes, affinity, failure reporting,
and an engine killed mid-batch that is restarted and re-synced to the current weight version."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from mrl.rollout.client import RolloutClient
from mrl.rollout.pool import EngineEndpoint, EnginePool
from mrl.rollout.router import Router
from mrl.rollout.sglang_launcher import EngineProcess, build_embedded_command
from mrl.rollout.types import RolloutRequest
from mrl.rollout.weight_sync import WeightSyncer, WeightVerifyError, disk_resync
from tests.helpers.dist import free_port
from tests.helpers.tiny_models import build_tiny_model, make_tiny_hf

pytestmark = pytest.mark.slow

TOKEN = "per-run-test-token"  # engines require it on control endpoints; the pool and syncer send it
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20], [30, 31], [40, 41, 42, 43], [50, 51, 52], [60] * 6, [70, 71]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
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


@pytest.fixture
def pool(engines):
    pool = EnginePool([EngineEndpoint(p.url, p.restart) for p in engines], token=TOKEN, health_interval_s=0,
                      restart_timeout_s=180)
    yield pool
    pool.close()


def _checksums(url: str) -> dict[str, str]:
    assert httpx.post(url + "/weights_checksum", json={}, timeout=60, trust_env=False).status_code == 401
    r = httpx.post(url + "/weights_checksum", json={}, headers=AUTH, timeout=60, trust_env=False)
    r.raise_for_status()
    return r.json()["checksums"]


def test_batch_shapes_affinity_and_balance(pool):
    client = RolloutClient(Router(pool))
    served = [e.served for e in pool.engines]
    res = client.generate(RolloutRequest(PROMPTS, n=4, sampling_params={"max_new_tokens": 8, "temperature": 1.0}))
    assert len(res.samples) == 32 and not res.failed
    assert [e.served - s for e, s in zip(pool.engines, served)] == [1, 1]  # one batch request per engine
    assert [(s.prompt_index, s.sample_index) for s in res.samples] == [(i, j) for i in range(8) for j in range(4)]
    for s in res.samples:
        assert s.prompt_ids == PROMPTS[s.prompt_index]
        assert 1 <= s.response_length <= 8 and len(s.rollout_log_probs) == s.response_length
        assert all(lp <= 0.0 for lp in s.rollout_log_probs)
        assert s.finish_reason in ("stop", "length")
        assert s.finish_reason == "stop" or s.response_length == 8
        assert s.weight_version == "default"  # SGLang's version before any update
    # the n samples of one prompt share an engine; prompts spread over both engines
    per_prompt = [{s.engine_url for s in res.samples[4 * i:4 * i + 4]} for i in range(8)]
    assert all(len(u) == 1 for u in per_prompt)
    assert {u for (u,) in per_prompt} == {e.url for e in pool.engines}
    pad = res.to_padded()
    r = max(res.response_lengths)
    assert pad["responses"].shape == pad["rollout_log_probs"].shape == pad["response_mask"].shape == (32, r)
    assert pad["response_mask"].sum().item() == sum(res.response_lengths)
    assert pool.loop.run(pool.check_health()) == {e.url: True for e in pool.engines}


def test_large_requests_are_cut_into_bounded_chunks(pool):
    """More than PROMPTS_PER_REQUEST prompts per engine go as several requests (answers parsed as they come)."""
    from mrl.rollout.client import PROMPTS_PER_REQUEST

    P = 2 * PROMPTS_PER_REQUEST + 6  # over 2 engines: ceil(70 / 32) = 3 requests, not 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(P)]
    served = sum(e.served for e in pool.engines)
    res = RolloutClient(Router(pool)).generate(RolloutRequest(prompts, n=1, sampling_params={"max_new_tokens": 2}))
    assert not res.failed and [s.prompt_index for s in res.samples] == list(range(P))
    assert all(s.prompt_ids == prompts[s.prompt_index] for s in res.samples)
    assert sum(e.served for e in pool.engines) - served == 3


def test_sampling_seeds_make_draws_reproducible_across_engines_and_batches(pool):
    # issue 19: every sample carries its own sampling_seed, so its draws do not depend on which
    # engine serves it or what else is in the request
    client = RolloutClient(Router(pool))
    sp = {"max_new_tokens": 8, "temperature": 1.0}
    seeds = [[1000 * i + j for j in range(4)] for i in range(len(PROMPTS))]

    def tokens(prompts, seeds_):
        res = client.generate(RolloutRequest(prompts, n=4, sampling_params=sp, sampling_seeds=seeds_))
        assert not res.failed, res.failed[:1]
        return [[s.response_ids for s in res.samples[4 * i:4 * i + 4]] for i in range(len(prompts))]

    a = tokens(PROMPTS, seeds)
    assert a == tokens(PROMPTS, seeds)
    assert a[::-1] == tokens(PROMPTS[::-1], seeds[::-1])  # other engines, other batch neighbours
    assert a[3] == tokens([PROMPTS[3]], [seeds[3]])[0]
    assert a != tokens(PROMPTS, [[x + 1 for x in row] for row in seeds])
    assert len({tuple(r) for g in a for r in g}) > len(PROMPTS)  # samples of a group really differ


def test_rejected_request_is_reported_not_retried(pool):
    client = RolloutClient(Router(pool, max_retries=3))
    res = client.generate(RolloutRequest(PROMPTS[:2], n=2, sampling_params={"max_new_tokens": 4, "no_such_param": 1}))
    assert len(res.samples) == 4 and len(res.failed) == 4
    for s in res.samples:
        assert s.finish_reason == "error" and s.attempts == 1 and "HTTP 400" in s.error and "no_such_param" in s.error


def test_unreachable_engine_fails_samples_with_reason():
    dead = EnginePool([EngineEndpoint(f"http://127.0.0.1:{free_port()}")], health_interval_s=0)
    try:
        res = RolloutClient(Router(dead, max_retries=1, no_engine_wait_s=0.5)).generate(
            RolloutRequest([[1, 2]], n=2, sampling_params={"max_new_tokens": 2}))
    finally:
        dead.close()
    assert len(res.samples) == 2
    assert all(s.finish_reason == "error" and "connection error" in s.error and "no healthy engine" in s.error
               for s in res.samples)
    assert dead.engines[0].healthy is False


def test_periodic_health_check_takes_out_a_dead_engine(engines):
    calls = []

    def cannot_restart() -> None:
        calls.append(1)
        raise RuntimeError("host gone")

    dead = EngineEndpoint(f"http://127.0.0.1:{free_port()}", restart=cannot_restart)
    pool = EnginePool([EngineEndpoint(p.url) for p in engines] + [dead], health_interval_s=0.3, health_timeout_s=30)
    try:
        pool.start_health_checks()
        deadline = time.monotonic() + 30
        while (dead.healthy or pool._recoveries) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not dead.healthy and calls == [1]
        assert "recovery failed" in dead.last_error and "host gone" in dead.last_error
        assert [e.healthy for e in pool.engines[:2]] == [True, True]
        # routing skips it
        assert Router(pool).pick() in pool.engines[:2]
    finally:
        pool.close()


def test_kill_engine_mid_batch_then_restart_and_resync(pool, engines, tmp_path):
    # Version 1 of the weights reaches both engines over the (CPU shared-memory) tensor transport,
    # with a disk snapshot kept; a restarted engine comes back with its start weights and must be
    # re-synced from the snapshot to version 1 before serving.
    new = [(n, p.detach()) for n, p in build_tiny_model("qwen2", seed=7).named_parameters()]
    syncer = WeightSyncer("tensor", [e.url for e in engines], snapshot_dir=str(tmp_path / "w"), verify=True,
                          barrier=lambda: None, bucket_mb=0.1, token=TOKEN)
    rep = syncer.sync(new, version=1)
    with pytest.raises(WeightVerifyError, match="'model.norm.weight' on engine"):
        syncer._verify({"model.norm.weight": "0" * 32}, "1")  # what a dtype/mapping mismatch looks like
    syncer.close()
    assert rep.weight_version == "1" and rep.verified and rep.bytes == sum(t.numel() * 4 for _, t in new)
    assert rep.num_buckets > 1 and (tmp_path / "w" / "mrl_weight_version.txt").read_text() == "1"
    pool.weight_version = "1"
    pool.resync = disk_resync(str(tmp_path / "w"), token=TOKEN)
    want = _checksums(engines[1].url)

    client = RolloutClient(Router(pool, max_retries=3))
    out = {}
    # The victim holds its requests (paused in place) so they are certainly in flight when it dies,
    # however fast the other engine is (no timing decides the outcome).
    httpx.post(engines[0].url + "/pause_generation", json={"mode": "in_place"}, headers=AUTH, timeout=30,
               trust_env=False).raise_for_status()
    t = threading.Thread(target=lambda: out.setdefault("res", client.generate(
        RolloutRequest(PROMPTS, n=4, sampling_params={"max_new_tokens": 40, "ignore_eos": True}))))
    t.start()
    victim = pool.engines[0]
    deadline = time.monotonic() + 60
    while victim.outstanding == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert victim.outstanding > 0
    engines[0].kill()
    t.join(timeout=240)
    res = out["res"]
    assert len(res.samples) == 32 and not res.failed, [s.error for s in res.failed][:2]
    assert all(s.response_length == 40 for s in res.samples)
    assert res.weight_versions == {"1"}
    assert any(s.attempts > 1 for s in res.samples)  # the victim's requests were retried

    pool.wait_recovered(timeout_s=240)
    assert victim.healthy and victim.restarts == 1, victim.last_error
    assert pool.loop.run(pool.get_weight_version(victim)) == "1"
    assert _checksums(victim.url) == want


def test_sleeping_engines_are_not_probed_and_wake_in_two_stages(pool):
    """release_memory: engines cannot generate (503), yet the health loop must not take them out
    and restart them; resume weights then KV cache (verl's order) and they serve again."""
    client = RolloutClient(Router(pool))
    pool.release_memory()
    assert pool.asleep
    r = httpx.post(pool.engines[0].url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}},
                   timeout=30, trust_env=False)
    assert r.status_code == 503 and "released" in r.text
    assert pool.loop.run(pool.check_health()) == {}  # no probe while asleep
    assert all(e.healthy and e.restarts == 0 for e in pool.engines)
    pool.resume_memory(["weights"])
    assert pool.asleep  # the KV cache is still out: probes wait for it
    pool.resume_memory(["kv_cache"])
    assert not pool.asleep and all(pool.loop.run(pool.check_health()).values())
    res = client.generate(RolloutRequest(PROMPTS[:2], n=2, sampling_params={"max_new_tokens": 4}))
    assert len(res.samples) == 4 and not res.failed


def test_restarted_engine_rejoins_the_distributed_group(pool, engines):
    """No snapshot to re-sync from: the restarted engine waits out of service; the next sync forms
    the (gloo) group again with it, pushes the new version to both engines (checksums verified)
    and only then does it serve."""
    v1 = [(n, p.detach()) for n, p in build_tiny_model("qwen2", seed=11).named_parameters()]
    syncer = WeightSyncer("distributed", [e.url for e in engines], verify=True, barrier=lambda: None, bucket_mb=0.1,
                          token=TOKEN)
    try:
        syncer.sync(v1, version=1)
        pool.weight_version = "1"
        engines[1].kill()
        assert pool.loop.run(pool.check_health())[engines[1].url] is False  # taken out, restart started
        pool.wait_recovered(180)
        e1 = pool.engines[1]
        assert e1.awaiting_sync and not e1.healthy and pool.healthy_engines() == [pool.engines[0]]
        v2 = [(n, t + 0.01) for n, t in v1]
        syncer.rejoin()
        rep = syncer.sync(v2, version=2)
        assert rep.verified and rep.weight_version == "2"
        assert pool.readmit("2") == [e1.url] and e1.healthy and e1.restarts == 1 and not e1.awaiting_sync
        res = RolloutClient(Router(pool)).generate(RolloutRequest(PROMPTS, n=2, sampling_params={"max_new_tokens": 4}))
        assert not res.failed and res.weight_versions == {"2"}
    finally:
        syncer.close()
