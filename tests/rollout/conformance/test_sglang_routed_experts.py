"""``return_routed_experts`` of the embedded engine against SGLang 0.5.23's own code and an independent oracle.

The engine's ``meta_info["routed_experts"]`` is decoded with SGLang's ``extract_routed_experts_from_meta_info``
(the client-side decode SGLang ships) and re-encoded with SGLang's ``DetokenizerManager._b64_encode_per_request``
(the server-side encode) to the same string. Its rows are SGLang's (``[routed_experts_start_len, seqlen - 1)``
of prompt + output, ``expected_rows`` of its ``_maybe_collect_routed_experts``), and every MoE layer's ids
equal the top-k of softmax(router logits) of one unbatched transformers forward of the same tokens
(``output_router_logits``), computed here; a dense layer (Qwen2-MoE ``mlp_only_layers``) is all 0, as in
SGLang's zero-initialised capture buffer. Requests are batched (3 prompts of different lengths, n = 2,
sampled), so prefill padding and batched decode are covered, on both decode paths.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from mrl.rollout.engine.server import Engine, build_app
from tests.helpers.sglang_real import require
from tests.helpers.tiny_moe_checkpoints import (
    FAMILIES,
    LAYERS,
    TOP_K,
    make_tiny_moe_hf,
    reference_topk,
)

PROMPTS = [[5, 17, 33, 41, 7, 9], [11, 3], [60, 61, 62, 63]]


@pytest.fixture(scope="module")
def sglang_codec():
    require()
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.state_capturer.routed_experts import (
        extract_routed_experts_from_meta_info,
    )

    return extract_routed_experts_from_meta_info, DetokenizerManager._b64_encode_per_request


@pytest.mark.parametrize(("family", "decode_path"), [(f, "fast") for f in FAMILIES] + [("qwen2_moe", "transformers")])
def test_routed_experts_decode_with_sglang_and_match_router_topk(tmp_path, family, decode_path, sglang_codec):
    import transformers as tf

    decode, encode = sglang_codec
    path = make_tiny_moe_hf(tmp_path / family, family, seed=3)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), enable_return_routed_experts=True)
    assert engine.runner.decode_path == "fast"
    if decode_path == "transformers":
        engine.runner._decoder = None  # decode through the model's own forward (mrl/rollout/engine/decode.py)
    with TestClient(build_app(engine)) as c:
        for start in (0, 2):
            outs = c.post("/generate", json={
                "input_ids": PROMPTS, "return_routed_experts": True, "routed_experts_start_len": start,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "n": 2},
            }).json()
            assert len(outs) == 2 * len(PROMPTS)
            for k, out in enumerate(outs):
                prompt, output = PROMPTS[k // 2], out["output_ids"]
                seqlen = len(prompt) + len(output)
                flat = decode(out)  # SGLang's client decode: np.int32, flat
                assert flat.dtype == np.int32
                got = torch.from_numpy(flat.copy()).view(-1, LAYERS, TOP_K)
                assert got.shape[0] == max(0, seqlen - 1 - start)  # SGLang's expected_rows
                assert encode([got])[0] == out["meta_info"]["routed_experts"]  # SGLang's server encode, byte-equal
                ref = reference_topk(model, (prompt + output)[:-1])[start:]
                assert torch.equal(got, ref), f"{family} sample {k}: engine routing differs from the router top-k"


def test_routed_experts_refused_without_the_flag_and_start_len_checked(tmp_path):
    path = make_tiny_moe_hf(tmp_path / "m", "qwen3_moe")
    body = {"input_ids": PROMPTS[0], "return_routed_experts": True, "sampling_params": {"max_new_tokens": 2}}
    with TestClient(build_app(Engine(str(path)))) as c:
        assert c.get("/server_info").json()["enable_return_routed_experts"] is False  # SGLang's server-args key
        r = c.post("/generate", json=body)
        assert r.status_code == 400 and "--enable-return-routed-experts" in r.json()["error"]["message"]
        assert "routed_experts" not in c.post("/generate", json={**body, "return_routed_experts": False}).json()["meta_info"]
    with TestClient(build_app(Engine(str(path), enable_return_routed_experts=True))) as c:
        assert c.get("/server_info").json()["enable_return_routed_experts"] is True
        r = c.post("/generate", json={**body, "routed_experts_start_len": len(PROMPTS[0]) + 1})
        assert r.status_code == 400 and "routed_experts_start_len" in r.json()["error"]["message"]
        # a request that does not ask gets no key, as in SGLang
        assert "routed_experts" not in c.post("/generate", json={**body, "return_routed_experts": False}).json()["meta_info"]


def test_sglang_reads_the_clients_request():
    """SGLang's own GenerateReqInput reads the /generate body the client sends with return_routed_experts."""
    import asyncio
    from types import SimpleNamespace

    from mrl.rollout.client import RolloutClient
    from mrl.rollout.router import RouteOutcome
    from mrl.rollout.types import RolloutRequest, RoutedExpertsLayout

    require()
    from sglang.srt.managers.io_struct import GenerateReqInput

    sent: list[dict] = []

    class Recording:
        pool = SimpleNamespace(engines=[SimpleNamespace(healthy=True)])

        async def generate(self, payload, rid, timeout_s):
            sent.append(payload)
            return RouteOutcome(None, None, 1, "recorded, not sent")

    client = RolloutClient(Recording(), return_routed_experts=True,  # type: ignore[arg-type]
                           routed_experts_layout=RoutedExpertsLayout(LAYERS, TOP_K))
    asyncio.run(client.agenerate(RolloutRequest([[1, 2, 3], [4, 5]], n=2, sampling_params={"max_new_tokens": 4})))
    (body,) = sent
    req = GenerateReqInput(**body)
    req.normalize_batch_and_arguments()
    assert all(req[i].return_routed_experts and req[i].routed_experts_start_len == 0 for i in range(4))
