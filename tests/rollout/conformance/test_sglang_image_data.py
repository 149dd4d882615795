"""Vision-language /generate bodies (RolloutRequest.image_data) read by SGLang 0.5.23's own GenerateReqInput:
every sample gets its own prompt's pictures after SGLang's batch normalisation (n copies, prompt-major), and
SGLang's own ``load_image`` decodes what the client sends back to the picture."""
from __future__ import annotations

import asyncio

import pytest

from mrl.data.images import png_base64
from mrl.rollout.client import RolloutClient
from mrl.rollout.types import RolloutRequest
from tests.helpers.sglang_real import require
from tests.helpers.tiny_vlm import png
from tests.rollout.conformance.test_sglang_request_bodies import RecordingRouter

PAD = 5  # the prompts' image token (one per picture: SGLang expands it)


def _bodies(image_data, n: int, engines: int) -> list[dict]:
    router = RecordingRouter(engines)
    prompts = [[1, PAD, 9, PAD, 2], [1, PAD, 7], [1, 8, 8]]
    asyncio.run(RolloutClient(router).agenerate(  # type: ignore[arg-type]
        RolloutRequest(prompts, n=n, sampling_params={"max_new_tokens": 4}, image_data=image_data)))
    return router.payloads


@pytest.mark.parametrize("engines", [1, 3])
@pytest.mark.parametrize("n", [1, 2])
def test_image_data_reaches_each_sample(n, engines):
    require()
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.utils.common import load_image

    pics = [png(30, 20, 1), png(40, 28, 2), png(28, 56, 3)]
    enc = [png_base64({"bytes": p}) for p in pics]
    image_data = [[enc[0], enc[1]], [enc[2]], []]
    bodies = _bodies(image_data, n, engines)
    got = []  # per sample, as SGLang hands it to its multimodal processor
    for body in bodies:
        req = GenerateReqInput(**body)  # unknown keys raise TypeError here
        req.normalize_batch_and_arguments()
        subs = [req] if req.is_single else [req[i] for i in range(req.batch_size)]
        for sub in subs:
            got.append([x for x in (sub.image_data or []) if x is not None])
    want = [imgs for imgs in image_data for _ in range(n)]
    assert got == want
    sizes = [load_image(e)[0].size for e in enc]  # SGLang's decode of the client's strings
    assert sizes == [(30, 20), (40, 28), (28, 56)]


def test_text_only_request_sends_no_image_data():
    bodies = _bodies(None, 2, 1) + _bodies([[], [], []], 1, 3)
    assert all("image_data" not in b for b in bodies)


def test_image_data_must_match_the_prompts():
    with pytest.raises(ValueError, match="image_data must be 1 lists"):
        RolloutRequest([[1, 2]], image_data=[[], []])
