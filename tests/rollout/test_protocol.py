"""Protocol conformance: request/response JSON shapes of SGLang's native API (as documented in
sgl-project/sglang docs "native_api" and io_struct.py), checked against the embedded engine;
plus the request models' batch/validation rules."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from mrl.rollout.engine.server import Engine, build_app
from mrl.rollout.protocol import (
    GenerateReqInput,
    SamplingParams,
    UpdateWeightsFromDistributedReqInput,
)
from tests.helpers.tiny_models import make_tiny_hf

FINISH = {"type": str}
META = {"id": str, "finish_reason": FINISH, "prompt_tokens": int, "completion_tokens": int,
        "cached_tokens": int, "weight_version": str, "e2e_latency": float}
GEN = {"text": str, "output_ids": [int], "meta_info": META}
GEN_LP = {"text": str, "output_ids": [int], "meta_info": {**META, "output_token_logprobs": [[float, int, type(None)]]}}
OK = {"success": bool, "message": str}

# (method, path, request JSON, expected status, response shape); None shape = body not checked.
TABLE = [
    ("get", "/health", None, 200, None),
    ("get", "/health_generate", None, 200, None),
    ("get", "/get_model_info", None, 200, {"model_path": str, "tokenizer_path": str, "is_generation": bool,
                                            "weight_version": str}),
    ("get", "/get_weight_version", None, 200, {"weight_version": str}),
    ("post", "/generate", {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
     200, GEN),
    ("post", "/generate", {"input_ids": [1, 2, 3], "return_logprob": True,
                           "sampling_params": {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3,
                                               "stop": ["\n"], "stop_token_ids": [7], "ignore_eos": False,
                                               "skip_special_tokens": True, "no_stop_trim": False}}, 200, GEN_LP),
    ("post", "/generate", {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 2}}, 200, [GEN]),
    ("post", "/generate", {"text": ["a", "bc"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
                           "return_logprob": [True, False]}, 200, [GEN]),
    ("post", "/flush_cache", None, 200, None),
    ("post", "/pause_generation", {}, 200, {"status": str, "message": str, "num_paused_requests": int}),
    ("post", "/continue_generation", {}, 200, {"status": str, "message": str}),
    ("post", "/abort_request", {"rid": "nope"}, 200, {"success": bool}),
    ("post", "/update_weights_from_disk", {"model_path": "/nonexistent/dir"}, 400, OK),
    ("post", "/update_weights_from_tensor", {"shm_tensors": []}, 400, OK),  # outside begin/end_weight_update
    ("post", "/begin_weight_update", {}, 200, OK),
    ("post", "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["bfloat16"], "shapes": [[2]]}, 400, OK),
    ("post", "/update_weights_from_tensor", {"shm_tensors": []}, 200, {**OK, "weight_version": str}),
    ("post", "/end_weight_update", {}, 200, OK),
    ("post", "/end_weight_update", {}, 400, OK),
    ("post", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 3}, 200, [float]),
    ("post", "/weights_checksum", {"names": ["model.norm.weight"]}, 200, {"checksums": {"model.norm.weight": str},
                                                                         "weight_version": str}),
    ("post", "/release_memory_occupation", {}, 200, OK),
    ("post", "/resume_memory_occupation", {}, 200, OK),
]


def _check(shape, value, where="$"):
    if shape is None:
        return
    if isinstance(shape, dict):
        assert isinstance(value, dict), f"{where}: expected object, got {value!r}"
        for k, sub in shape.items():
            assert k in value, f"{where}: missing key {k!r} in {sorted(value)}"
            _check(sub, value[k], f"{where}.{k}")
    elif isinstance(shape, list):
        assert isinstance(value, list) and value, f"{where}: expected non-empty list, got {value!r}"
        for i, v in enumerate(value):
            _check(shape[0] if len(shape) == 1 else shape[i], v, f"{where}[{i}]")
    else:
        ok = isinstance(value, shape) and not (shape is int and isinstance(value, bool))
        if shape is float:
            ok = isinstance(value, (float, int)) and not isinstance(value, bool)
        assert ok, f"{where}: expected {shape.__name__}, got {value!r}"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = make_tiny_hf(tmp_path_factory.mktemp("proto") / "m", "llama")
    with TestClient(build_app(Engine(str(d)))) as c:
        yield c


@pytest.mark.parametrize("method,path,body,status,shape", TABLE, ids=[f"{m} {p} {i}" for i, (m, p, *_ ) in enumerate(TABLE)])
def test_conformance(client, method, path, body, status, shape):
    r = client.request(method.upper(), path, json=body) if body is not None else client.request(method.upper(), path)
    assert r.status_code == status, r.text
    if shape is not None:
        _check(shape, r.json())


def test_finish_reason_shape(client):
    out = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


def test_batch_items_and_rid_prefix():
    req = GenerateReqInput(input_ids=[[1], [2, 3]], rid="r", sampling_params={"max_new_tokens": 3}, return_logprob=True)
    assert req.is_batch and req.batch_size == 2
    text, ids, sp, lp, rid = req.item(1)
    assert (text, ids, sp.max_new_tokens, lp, rid) == (None, [2, 3], 3, True, "r_1")
    single = GenerateReqInput(input_ids=[4, 5])
    assert not single.is_batch and single.item(0)[1] == [4, 5]
    with pytest.raises(ValueError, match="2 prompts"):
        GenerateReqInput(input_ids=[[1], [2]], sampling_params=[{}]).item(0)


def test_request_validation_errors():
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateReqInput(text="a", input_ids=[1])
    assert GenerateReqInput(text="a", stream=True).stream
    with pytest.raises(ValidationError, match="top_logprobs_num=-1"):
        GenerateReqInput(text="a", top_logprobs_num=-1)
    with pytest.raises(ValidationError, match="stop_regex"):
        SamplingParams(stop_regex="(")
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValidationError, match="unknown sampling_params key 'tempreature'"):
        SamplingParams(tempreature=1.0)
    assert SamplingParams(min_new_tokens=0, spaces_between_special_tokens=True).max_new_tokens == 128
    with pytest.raises(ValidationError, match="lengths differ"):
        UpdateWeightsFromDistributedReqInput(names=["a"], dtypes=[], shapes=[[1]])
    assert SamplingParams(stop="x").stop_strings == ["x"]
