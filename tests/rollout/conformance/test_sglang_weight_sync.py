"""Our weight-sync sender against SGLang's own code (the pinned release), on CPU over gloo.

Two SGLang engines (sglang_harness.py: SGLang's HTTP app, scheduler-side weight-update manager and
model-runner receive code) receive a full sync from ``WeightSyncer``; every request body we send
is also validated against SGLang's ``io_struct`` schema and checked for keys SGLang would ignore.
Run alone: ``pytest tests/rollout/conformance``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from mrl.rollout.engine.checksum import tensor_checksum
from mrl.rollout.weight_sync import WeightSyncer
from mrl.rollout.weight_sync.buckets import iter_buckets
from mrl.rollout.weight_sync.http import EngineCallError, EngineHttp
from tests.helpers.dist import free_port
from tests.helpers.serving import wait_http_ok
from tests.helpers.sglang_real import require

REPO = Path(__file__).resolve().parents[3]

# path -> SGLang io_struct class its body must validate as (None: no body).
ROUTES = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/flush_cache": None,
}


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes in an order that is unaligned when packed as given: an odd-length bf16 vector
    before fp32 matrices (SGLang refuses such offsets)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.norm.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(5, generator=g).to(torch.float16),
        "lm_head.weight": torch.randn(16, 8, generator=g),
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
    }


@pytest.fixture(scope="module")
def sglang():
    return require()


@pytest.fixture(scope="module")
def engines(tmp_path_factory, sglang):
    d = tmp_path_factory.mktemp("sgl")
    save_file({k: torch.zeros_like(v) for k, v in weights(0).items()}, str(d / "model.safetensors"))
    procs, urls = [], []
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.rollout.conformance.sglang_harness", "--port",
                                       str(port), "--weights", str(d / "model.safetensors")], cwd=REPO, env=env))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for u, p in zip(urls, procs):
            wait_http_ok(u, p, "/harness/checksums", timeout_s=180)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def state(url: str) -> dict:
    return httpx.get(url + "/harness/checksums", timeout=10).json()


class Recorder:
    """Wraps EngineHttp.call to keep every (path, body) the sender sends."""

    def __init__(self, monkeypatch) -> None:
        self.sent: list[tuple[str, dict | None]] = []
        orig = EngineHttp.call

        def call(http, url, path, payload=None, method="POST"):
            self.sent.append((path, payload))
            return orig(http, url, path, payload, method)

        monkeypatch.setattr(EngineHttp, "call", call)


def check_against_io_struct(sent: list[tuple[str, dict | None]]) -> None:
    import msgspec
    import pydantic
    from sglang.srt.managers import io_struct

    for path, body in sent:
        assert path in ROUTES, f"the sender called {path}, which is not an SGLang control route we checked"
        cls_name = ROUTES[path]
        if cls_name is None:
            continue
        cls = getattr(io_struct, cls_name)
        pydantic.TypeAdapter(cls).validate_python(body or {})  # what SGLang's FastAPI route does
        fields = {f.name for f in msgspec.structs.fields(cls)}
        unknown = set(body or {}) - fields
        assert not unknown, f"{path}: SGLang's {cls_name} silently ignores {sorted(unknown)}"


def test_distributed_sync_into_sglang_engines(engines, monkeypatch):
    rec = Recorder(monkeypatch)
    syncer = WeightSyncer("distributed", engines, bucket_mb=0.0004, engine_world_sizes=[1, 1], timeout_s=60)
    try:
        for version, seed in (("1", 1), ("2", 2)):
            httpx.post(engines[0] + "/harness/requests", json={"running": 2}, timeout=10)  # busy: retract + flush
            w = weights(seed)
            report = syncer.sync(iter(w.items()), version)
            assert report.num_buckets > 1  # several buckets, each with its own mixed-dtype layout
            for u in engines:
                st = state(u)
                assert st["checksums"] == {n: tensor_checksum(t) for n, t in w.items()}, u
                assert st["weight_version"] == version
        calls = state(engines[0])["calls"]
        assert calls[0] == "InitWeightsUpdateGroupReqInput"
        assert calls[1:5] == ["pause:retract", "flush", "BeginWeightUpdateReqInput", "UpdateWeightsFromDistributedReqInput"]
        assert "EndWeightUpdateReqInput" in calls and calls[-1] == "continue"
        # A restarted engine is met by re-forming the group: SGLang's destroy then init, no leftovers.
        syncer.rejoin()
        assert state(engines[1])["groups"] == ["mrl_weight_sync_pp0"]
        w = weights(3)
        syncer.sync(iter(w.items()), "3")
        assert state(engines[1])["checksums"] == {n: tensor_checksum(t) for n, t in w.items()}
        # The synchronous step's push (pause=False): no pause/continue round trips, the flush and window stay.
        httpx.post(engines[0] + "/harness/requests", json={"running": 0}, timeout=10)  # the step's rollout has ended
        before = len(state(engines[0])["calls"])
        w = weights(4)
        syncer.sync(iter(w.items()), "4", pause=False)
        calls = state(engines[0])["calls"][before:]
        assert calls[:3] == ["flush", "BeginWeightUpdateReqInput", "UpdateWeightsFromDistributedReqInput"], calls
        assert "EndWeightUpdateReqInput" in calls and not {"pause:retract", "continue"} & set(calls), calls
        for u in engines:
            assert state(u)["checksums"] == {n: tensor_checksum(t) for n, t in w.items()} and state(u)["weight_version"] == "4"
    finally:
        syncer.close()
    assert state(engines[0])["groups"] == []
    check_against_io_struct(rec.sent)


def test_sglang_refuses_what_the_old_sender_did(engines):
    """The pre-fix behaviours, each refused by SGLang's own code."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    w = weights(4)
    # 1. A bucket packed in arrival order has a misaligned offset; ours is ordered by itemsize.
    names, ts = list(w), list(w.values())
    with pytest.raises(ValueError, match="Unaligned"):
        FlattenedTensorBucket.empty(names, [str(t.dtype).removeprefix("torch.") for t in ts],
                                    [list(t.shape) for t in ts], "cpu")
    for b in iter_buckets(w.items(), 1 << 20):
        FlattenedTensorBucket.empty(b.names, b.dtypes, b.shapes, "cpu")
    # 2. An update outside begin/end_weight_update (SGLang >= 0.5.22) is a 400.
    http = EngineHttp(engines[:1], timeout_s=30)
    try:
        with pytest.raises(EngineCallError, match="between begin_weight_update"):
            http.call(engines[0], "/update_weights_from_distributed",
                      {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[16, 8]], "group_name": "none"})
        # 3. Flushing while requests run (pause in_place keeps them) is refused; our sender waits,
        #    then names the cause.
        httpx.post(engines[0] + "/harness/requests", json={"running": 1}, timeout=10)
        with pytest.raises(EngineCallError, match="HTTP 400"):
            http.call(engines[0], "/flush_cache")
        stuck = WeightSyncer("distributed", engines[:1], pause_mode="in_place", timeout_s=1.5)
        try:
            with pytest.raises(EngineCallError, match="still busy"):
                stuck.sync(iter(w.items()), "9")
        finally:
            stuck.close()  # leaves the group on both sides (a later sync in this process reuses its name)
        http.call(engines[0], "/pause_generation", {"mode": "abort"})
        http.call(engines[0], "/continue_generation", {})
    finally:
        http.close()


@pytest.mark.timeout(120)
def test_group_without_prefix_store_never_meets_sglang(engines):  # runs after the tests that sync
    """The pre-fix group helper (no PrefixStore) cannot form a group with SGLang's receiver."""
    import datetime

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    port = free_port()
    # SGLang's side waits out its own rendezvous timeout (30 min), so its call is not awaited: the
    # harness process ends with the module.
    http = EngineHttp(engines[:1], timeout_s=10)
    try:
        http.submit_all("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                              "rank_offset": 1, "world_size": 2, "group_name": "g_old",
                                                              "backend": "gloo"})
        timeout = datetime.timedelta(seconds=5)
        store, rank, world = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
        store.set_timeout(timeout)
        with pytest.raises(Exception, match="(?i)timeout|timed out"):
            c10d._new_process_group_helper(world, rank, [], "gloo", store, group_name="g_old", timeout=timeout)
    finally:
        http.close()


def test_cuda_ipc_payload_contract_on_cpu(sglang):
    """serialized_named_tensors: one serialization per engine tp rank, accepted by SGLang's schema
    and read back by SGLang's own (safe) deserializer for each rank. CPU tensors stand in for CUDA
    ones: the IPC handles and SGLang's device-UUID reductions themselves need GPUs."""
    import pydantic
    from sglang.srt.managers import io_struct
    from sglang.srt.utils import MultiprocessingSerializer

    from mrl.rollout.weight_sync.transports import cuda_ipc_payloads

    w = weights(5)
    payloads = cuda_ipc_payloads(list(w.items()), 2, lambda n: MultiprocessingSerializer.serialize(n, output_str=True))
    assert len(payloads) == 2 and payloads[0] != payloads[1]  # one producer reference per rank
    body = {"serialized_named_tensors": payloads, "weight_version": "1", "flush_cache": False}
    parsed = pydantic.TypeAdapter(io_struct.UpdateWeightsFromTensorReqInput).validate_python(body)
    for tp_rank in range(2):
        got = MultiprocessingSerializer.deserialize(parsed.serialized_named_tensors[tp_rank])
        assert [n for n, _ in got] == list(w) and all(torch.equal(t, w[n]) for n, t in got)
