"""Rollout client: SGLang /generate answers parsed into samples; typed records and padding."""
import pytest
import torch

from mrl.rollout.client import parse_generate_response
from mrl.rollout.types import RolloutRequest, RolloutResult, RolloutSample

# Shape of SGLang's native /generate answer with return_logprob (docs "native_api"); older
# servers omit output_ids, so ids come from output_token_logprobs then.
SGLANG_ANSWER = {
    "text": " Paris.",
    "output_ids": [12366, 13, 2],
    "meta_info": {
        "id": "f3b1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 7,
        "completion_tokens": 3, "cached_tokens": 0, "weight_version": "4",
        "output_token_logprobs": [[-0.25, 12366, None], [-1.5, 13, None], [-0.125, 2, None]],
    },
}


def test_parse_sglang_answer_with_and_without_output_ids():
    ids, lps, reason, wv = parse_generate_response(SGLANG_ANSWER)
    assert ids == [12366, 13, 2] and lps == [-0.25, -1.5, -0.125] and reason == "stop" and wv == "4"
    old = {"text": "x", "meta_info": {**SGLANG_ANSWER["meta_info"], "finish_reason": {"type": "length", "length": 3}}}
    ids2, _, reason2, _ = parse_generate_response(old)
    assert ids2 == ids and reason2 == "length"


def test_request_validation_names_the_field():
    with pytest.raises(ValueError, match="rollout.n"):
        RolloutRequest([[1]], n=0)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        RolloutRequest([[1], []], n=1)


def test_to_padded_keeps_failed_rows_empty():
    ok = RolloutSample(0, 0, [1], [5, 6, 7], [-0.5, -0.25, -1.0], "length", "1")
    short = RolloutSample(0, 1, [1], [9], [-2.0], "stop", "1")
    bad = RolloutSample(1, 0, [2], [], [], "error", error="HTTP 503")
    res = RolloutResult([ok, short, bad], n=2)
    pad = res.to_padded(pad_token_id=0)
    assert pad["responses"].tolist() == [[5, 6, 7], [9, 0, 0], [0, 0, 0]]
    assert pad["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert torch.equal(pad["rollout_log_probs"][0], torch.tensor([-0.5, -0.25, -1.0]))
    assert pad["response_lengths"].tolist() == [3, 1, 0]
    assert res.failed == [bad] and res.weight_versions == {"1"} and res.finish_reasons == ["length", "stop", "error"]
