"""Every request body the rollout side sends, read by SGLang's own request types (the pinned release):
/generate as the trainer, validation and ReMax build it, and the pool's control calls."""
from __future__ import annotations

import asyncio

import pytest

from mrl.rollout.client import RolloutClient
from mrl.rollout.router import RouteOutcome
from mrl.rollout.types import RolloutRequest
from tests.helpers.sglang_real import require

VOCAB = 300


class RecordingRouter:
    def __init__(self) -> None:
        self.payloads: list[dict] = []

    async def generate(self, payload, rid, timeout_s):
        self.payloads.append(payload)
        return RouteOutcome(None, None, 1, "recorded, not sent")


def sent_generate_bodies(sampling_params: dict, n: int, seeded: bool) -> list[dict]:
    router = RecordingRouter()
    client = RolloutClient(router)  # type: ignore[arg-type]
    seeds = [[1000 * i + j for j in range(n)] for i in range(2)] if seeded else None
    asyncio.run(client.agenerate(RolloutRequest([[5, 6, 7], [8, 9]], n=n, sampling_params=sampling_params,
                                                sampling_seeds=seeds)))
    return router.payloads


@pytest.mark.parametrize("seeded", [False, True])  # the trainer sends one sampling_seed per sample
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("sampling_params", [
    {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16},  # the trainer's rollout
    {"temperature": 0.0, "max_new_tokens": 16},  # validation (greedy) and ReMax baselines
    {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 8, "sampling_seed": 123},
])
def test_generate_bodies_are_valid_sglang_requests(sampling_params, n, seeded):
    require()
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    for body in sent_generate_bodies(sampling_params, n, seeded):
        req = GenerateReqInput(**body)  # unknown keys raise TypeError here
        req.normalize_batch_and_arguments()
        assert req.batch_size == n and req.is_single == (n == 1)
        per_sample = [req.sampling_params] if n == 1 else [req[i].sampling_params for i in range(n)]
        for sp_dict in per_sample:  # what SGLang's tokenizer manager builds for each sample
            sp = SamplingParams(**sp_dict)
            sp.verify(VOCAB)
            assert sp.max_new_tokens == sampling_params["max_new_tokens"]
        if seeded:
            assert len({sp["sampling_seed"] for sp in per_sample}) == n  # one seed per sample reaches SGLang


CONTROL = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/flush_cache": None,
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
}


def test_control_bodies_are_valid_sglang_requests(monkeypatch, tmp_path):
    """Bodies captured from the real EnginePool methods and the disk transport / disk_resync."""
    require()
    import msgspec
    import pydantic
    from sglang.srt.managers import io_struct

    from mrl.rollout.pool import EngineEndpoint, EnginePool
    from mrl.rollout.weight_sync.http import EngineHttp
    from mrl.rollout.weight_sync.sender import disk_resync
    from mrl.rollout.weight_sync.transports import DiskTransport

    sent: list[tuple[str, dict | None]] = []
    monkeypatch.setattr(EnginePool, "control", lambda self, path, payload=None, **kw: sent.append((path, payload)) or {})
    monkeypatch.setattr(EngineHttp, "call", lambda self, url, path, payload=None, method="POST": sent.append(
        (path, payload)) or {})
    pool = EnginePool([EngineEndpoint("http://127.0.0.1:1")])
    try:
        pool.pause()
        pool.flush()
        pool.resume()
        pool.release_memory()
        pool.resume_memory(["weights"])
        pool.resume_memory(["kv_cache"])
        pool.resume_memory()
    finally:
        pool.close()
    http = EngineHttp(["http://127.0.0.1:1"])
    DiskTransport(http, tmp_path, 0).load_on_engines("3")
    http.close()
    (tmp_path / "mrl_weight_version.txt").write_text("3")
    disk_resync(str(tmp_path))("http://127.0.0.1:1")
    assert {p for p, _ in sent} == set(CONTROL)
    for path, body in sent:
        cls_name = CONTROL[path]
        if cls_name is None:
            continue
        cls = getattr(io_struct, cls_name)
        pydantic.TypeAdapter(cls).validate_python(body or {})
        assert set(body or {}) <= {f.name for f in msgspec.structs.fields(cls)}, f"{path}: SGLang ignores a key of {body}"
    assert ("/pause_generation", {"mode": "retract"}) in sent  # samples in flight survive a pool pause
