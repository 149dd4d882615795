"""Every request body the rollout side sends, read by SGLang's own request types (the pinned release):
/generate as the trainer, validation and ReMax build it, and the pool's control calls."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from mrl.rollout.client import RolloutClient
from mrl.rollout.router import RouteOutcome
from mrl.rollout.types import RolloutRequest
from tests.helpers.sglang_real import require

VOCAB = 300


class RecordingRouter:
    def __init__(self, engines: int = 1) -> None:
        self.payloads: list[dict] = []
        self.pool = SimpleNamespace(engines=[SimpleNamespace(healthy=True)] * engines)  # the client cuts per engine

    async def generate(self, payload, rid, timeout_s):
        self.payloads.append(payload)
        return RouteOutcome(None, None, 1, "recorded, not sent")


def sent_generate_bodies(sampling_params: dict, n: int, seeded: bool, engines: int) -> list[dict]:
    router = RecordingRouter(engines)
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
@pytest.mark.parametrize("engines", [1, 2])  # 2 prompts: one body of both, or one body per prompt
def test_generate_bodies_are_valid_sglang_requests(sampling_params, n, seeded, engines):
    require()
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    bodies = sent_generate_bodies(sampling_params, n, seeded, engines)
    assert len(bodies) == engines
    for body in bodies:
        k = n * (2 // engines)  # samples in this body
        req = GenerateReqInput(**body)  # unknown keys raise TypeError here
        req.normalize_batch_and_arguments()
        assert req.batch_size == k and req.is_single == (k == 1)
        per_sample = [req.sampling_params] if k == 1 else [req[i].sampling_params for i in range(k)]
        for sp_dict in per_sample:  # what SGLang's tokenizer manager builds for each sample
            sp = SamplingParams(**sp_dict)
            sp.verify(VOCAB)
            assert sp.max_new_tokens == sampling_params["max_new_tokens"]
        if seeded:
            assert len({sp["sampling_seed"] for sp in per_sample}) == k  # one seed per sample reaches SGLang


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


def test_agent_loop_bodies_are_valid_sglang_requests():
    """The agent loop's turns (docs/agent.md): each a single /generate with input_ids = prompt + the
    trajectory so far (the tool segment appended as ids), its own sampling_seed, read by SGLang."""
    require()
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams
    from transformers import PreTrainedTokenizerFast

    from mrl.agent.loop import AgentClient
    from mrl.agent.template import tool_segment_ids
    from mrl.agent.tools import load_tools
    from mrl.config.agent import AgentConfig
    from mrl.quickstarts.agent import CHAT_TEMPLATE
    from tests.helpers.tiny_tokenizer import build_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    call = tok('<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 3"}}</tool_call>',
               add_special_tokens=False)["input_ids"] + [2]
    answer = tok(" 36", add_special_tokens=False)["input_ids"] + [2]

    class ScriptedRouter(RecordingRouter):  # answers turn 1 with a call and turn 2 with an answer, as SGLang shapes them
        pool = None

        async def generate(self, payload, rid, timeout_s):
            self.payloads.append(payload)
            ids = call if len(self.payloads) == 1 else answer
            return RouteOutcome({"output_ids": ids, "meta_info": {
                "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "default",
                "output_token_logprobs": [[-0.5, i, None] for i in ids]}}, "http://engine", 1, None)

    router = ScriptedRouter()
    agent = AgentClient(RolloutClient(router), tok, load_tools(["calculator"]), AgentConfig(enable=True))  # type: ignore[arg-type]
    prompt = [5, 6, 7]

    async def run():
        try:
            return await agent.agenerate(RolloutRequest([prompt], n=1, sampling_params={
                "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 128}, sampling_seeds=[[7]]))
        finally:
            await agent.runner.aclose()
    res = asyncio.run(run())
    (s,) = res.samples
    assert s.agent['tool_calls'] and s.agent['tool_calls'][0]['result'] == '36', (s.agent, s.error)
    seg = tool_segment_ids(tok, ["36"], 2)
    assert s.response_ids == call + seg + answer and s.loss_mask == [1] * len(call) + [0] * len(seg) + [1] * len(answer)
    first, second = router.payloads
    assert first["input_ids"] == prompt and second["input_ids"] == prompt + call + seg
    seeds = []
    for body, budget in ((first, 128), (second, 128 - len(call) - len(seg))):
        req = GenerateReqInput(**body)  # unknown keys raise TypeError here
        req.normalize_batch_and_arguments()
        assert req.is_single and req.batch_size == 1
        sp = SamplingParams(**req.sampling_params)
        sp.verify(VOCAB)
        assert sp.max_new_tokens == budget
        seeds.append(req.sampling_params["sampling_seed"])
    assert len(set(seeds)) == 2
