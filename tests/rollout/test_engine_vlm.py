"""The embedded engine serving tiny Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE checkpoints (and Qwen3.5's hybrid decoder in one test) over SGLang's /generate with
``image_data``: prompts with two, one and no pictures batched together (and the same text with another
picture), n samples each. Every sampled token's log-prob must equal a plain transformers forward over
prompt + response with the pictures (fp32, <= 1e-5: the same float32 ops in another batch layout; the
non-VLM engine tests hold the same bound). The reference expands the image tokens itself from transformers'
image processor and lets the model compute its own multimodal positions (no position_ids passed)."""
from __future__ import annotations

import base64
import io

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from mrl.rollout.engine.server import Engine, build_app
from tests.helpers.tiny_models import make_tiny_hf
from tests.helpers.tiny_vlm import SPECIALS, png, save_tiny_vlm

TOL = 1e-5
PICS = {"a": png(40, 60, 1), "b": png(90, 30, 2), "c": png(28, 28, 3), "d": png(40, 60, 4)}  # d: a's size, other pixels


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def vlm(request, tmp_path_factory):
    d = save_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)
    engine = Engine(str(d))
    client = TestClient(build_app(engine))
    with client:
        yield d, engine, client


def _text(pads: list[int], question: str) -> str:
    vis = "".join(f"<|vision_start|>{'<|image_pad|>' * n}<|vision_end|>" for n in pads)
    return f"<|im_start|>user\n{vis}{question}<|im_end|>\n<|im_start|>assistant\n"


def _hf_pixels(d, names: list[str]):
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(d, backend="pil")
    out = proc(images=[Image.open(io.BytesIO(PICS[n])).convert("RGB") for n in names], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"], [int(g.prod()) // proc.merge_size ** 2 for g in out["image_grid_thw"]]


def _ref_logits(d, model, tok, names: list[str], question: str, fed: list[int]):
    """(logits [len(prompt + fed), V], prompt length) of transformers' forward over the expanded prompt + ``fed``."""
    kw = {}
    pads = [1] * len(names)
    if names:
        pv, grid, pads = _hf_pixels(d, names)
        kw = {"pixel_values": pv, "image_grid_thw": grid}
    prompt = tok(_text(pads, question), add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + fed])
    model.model.rope_deltas = None  # transformers caches them from a previous call
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), **kw).logits
    return logits[0], len(prompt)


def _ref_logprobs(d, model, tok, names: list[str], question: str, output: list[int], temperature: float):
    """log p(output[t]) by the reference; the last output token is never fed (as in the engine)."""
    logits, n = _ref_logits(d, model, tok, names, question, output[:-1])
    lp = torch.log_softmax(logits[n - 1:] / temperature, dim=-1)
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1), n


# A random model may sample a vision token; fed back, it would be read as a picture's slot: stop there.
VISION_IDS = [SPECIALS.index(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")]


ROWS = [(["a", "b"], "Which is wider?"), (["c"], "What colour?"), ([], "No picture here."),
        (["d"], "Which is wider?"), (["d", "b"], "Which is wider?")]  # a's text and token count, other pixels


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers_with_pictures(vlm, temperature, tmp_path):
    d, _, client = vlm
    _check_logprobs(d, client, temperature, tmp_path)


def test_hybrid_qwen3_5_logprobs_match_transformers_with_pictures(tmp_path):
    """Qwen3.5 (Gated DeltaNet layers with their recurrent state, gated attention with interleaved mRoPE on a quarter
    of each head): the same batch through the hybrid engine's decode, at temperature 1."""
    d = save_tiny_vlm(tmp_path / "qwen3_5", "qwen3_5")
    engine = Engine(str(d))
    assert engine.runner.hybrid is not None and engine.runner.vision is not None
    with TestClient(build_app(engine)) as client:
        _check_logprobs(d, client, 1.0, tmp_path)


def _check_logprobs(d, client, temperature: float, tmp_path) -> None:
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    (tmp_path / "c.png").write_bytes(PICS["c"])
    as_sent = {"a": base64.b64encode(PICS["a"]).decode(), "b": "data:image/png;base64," + base64.b64encode(PICS["b"]).decode(),
               "c": str(tmp_path / "c.png"), "d": base64.b64encode(PICS["d"]).decode()}
    ids = [tok(_text([1] * len(names), q), add_special_tokens=False)["input_ids"] for names, q in ROWS]
    body = {"input_ids": ids, "image_data": [[as_sent[n] for n in names] for names, _ in ROWS], "return_logprob": True,
            "sampling_params": {"temperature": temperature, "max_new_tokens": 8, "ignore_eos": True, "n": 2,
                                "stop_token_ids": VISION_IDS}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 2 * len(ROWS)
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    worst = 0.0
    for k, out in enumerate(outs):
        names, q = ROWS[k // 2]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        ref, prompt_len = _ref_logprobs(d, model, tok, names, q, out["output_ids"], temperature)
        assert out["meta_info"]["prompt_tokens"] == prompt_len  # SGLang counts the expanded prompt
        assert (got - ref).abs().max() <= TOL, (k, (got - ref).abs().max())
        worst = max(worst, float((got - ref).abs().max()))
    print(f"max |engine - transformers| log-prob: {worst:.2e}")


def test_single_request_and_re_prefill_keep_their_picture(vlm):
    """A single (non-batch) body with its list of pictures; then the prefill a retracted request gets (prompt +
    the tokens it had sampled, its pictures kept on the request) gives the next token's logits of the
    reference forward."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    d, engine, client = vlm
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok(_text([1], "Describe."), add_special_tokens=False)["input_ids"]
    body = {"input_ids": ids, "image_data": [base64.b64encode(PICS["a"]).decode()], "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "stop_token_ids": VISION_IDS}}
    out = client.post("/generate", json=body).json()
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    ref, _ = _ref_logprobs(d, model, tok, ["a"], "Describe.", out["output_ids"], 1.0)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert (got - ref).abs().max() <= TOL
    sampled = tok("The", add_special_tokens=False)["input_ids"]  # what a retracted request had sampled
    expanded, vision = engine.runner.vision.prepare(ids, body["image_data"])
    with engine.scheduler.model_lock:
        _, logits = engine.runner.prefill([expanded + sampled], vision=[vision])
    ref_logits, _ = _ref_logits(d, model, tok, ["a"], "Describe.", sampled)
    assert (torch.log_softmax(logits[0], -1) - torch.log_softmax(ref_logits[-1], -1)).abs().max() <= TOL


@pytest.mark.parametrize("bad,match", [
    ({"image_data": []}, "image token.*no image_data"),
    ({"image_data": ["aGVsbG8=", "aGVsbG8="]}, "image_data\\[0\\]: the image bytes are not a readable picture"),
    ({"image_data": [base64.b64encode(PICS["a"]).decode()] * 2}, "1 image token\\(s\\) for 2 image\\(s\\)"),
    ({"image_data": [base64.b64encode(PICS["a"]).decode()], "logprob_start_len": 0, "return_logprob": True},
     "logprob_start_len >= 0 with image_data"),
])
def test_bad_pictures_are_refused(vlm, bad, match):
    import re

    d, _, client = vlm
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(d)(_text([1], "x"), add_special_tokens=False)["input_ids"]
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, **bad})
    assert r.status_code == 400 and re.search(match, r.json()["error"]["message"]), r.text


def test_model_and_server_info_say_vision(vlm):
    _, engine, client = vlm
    assert client.get("/model_info").json()["has_image_understanding"] is True
    assert client.get("/server_info").json()["context_length"] == 512  # the text config's max_position_embeddings
    assert engine.runner.decode_path == "transformers forward (vision-language model)"


def test_text_model_refuses_image_data(tmp_path):
    engine = Engine(str(make_tiny_hf(tmp_path / "q", "qwen2")))
    with TestClient(build_app(engine)) as client:
        r = client.post("/generate", json={"input_ids": [5, 6], "image_data": [base64.b64encode(PICS["a"]).decode()],
                                           "sampling_params": {"max_new_tokens": 2}})
        assert client.get("/model_info").json()["has_image_understanding"] is False
    assert r.status_code == 400 and "image_data needs a vision-language model" in r.text


def test_dataset_rows_through_the_client_to_the_engine(vlm, tmp_path):
    """Rows of a prompt file -> RolloutRequest (engine ids, pictures as the client sends them) -> the body the
    rollout client builds -> the engine: the engine's expanded prompt is the dataset's trainer prompt, and the
    log-probs match transformers over the trainer prompt + response with the rows' pictures."""
    import asyncio
    import json

    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from mrl.data.dataset import PromptDataset
    from mrl.data.images import VisionSpec, png_base64
    from mrl.rollout.client import RolloutClient
    from mrl.rollout.types import RolloutRequest
    from tests.rollout.conformance.test_sglang_request_bodies import RecordingRouter

    d, _, client = vlm
    tok = AutoTokenizer.from_pretrained(d)
    (tmp_path / "b.png").write_bytes(PICS["b"])
    rows = [{"prompt": [{"role": "user", "content": "<image> then <image>?"}], "reward_model": {"ground_truth": "1"},
             "images": [{"bytes": base64.b64encode(PICS["a"]).decode()}, str(tmp_path / "b.png")]},
            {"prompt": [{"role": "user", "content": "none"}], "reward_model": {"ground_truth": "1"}, "images": []}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = PromptDataset([tmp_path / "p.jsonl"], tok, vision=VisionSpec.from_checkpoint(d))
    router = RecordingRouter(1)
    request = RolloutRequest([p.engine_prompt_ids for p in ds.prompts], n=2, image_data=[
        [png_base64(ref) for ref in p.images] for p in ds.prompts], sampling_params={
        "temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "stop_token_ids": VISION_IDS})
    asyncio.run(RolloutClient(router).agenerate(request))  # type: ignore[arg-type]
    (body,) = router.payloads
    outs = client.post("/generate", json=body).json()
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    pv, grid, _ = _hf_pixels(d, ["a", "b"])
    for k, out in enumerate(outs):
        p = ds.prompts[k // 2]
        assert out["meta_info"]["prompt_tokens"] == len(p.prompt_ids)
        ids = torch.tensor([p.prompt_ids + out["output_ids"][:-1]])
        kw = {"pixel_values": pv, "image_grid_thw": grid} if p.images else {}
        model.model.rope_deltas = None
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(), **kw).logits[0]
        ref = torch.log_softmax(logits[len(p.prompt_ids) - 1:], -1).gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert (got - ref).abs().max() <= TOL
