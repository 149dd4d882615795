"""Vision-language prompt rows (mrl/data/images.py, PromptDataset with a VisionSpec): verl's multimodal
parquet and the same fields in JSONL, pictures as bytes / {"bytes"} / paths / file:// URLs, one or
several per prompt. References are transformers' own Qwen-VL image processor (its image_grid_thw) and the
tokenizer over text written with every image token spelled out; neither shares mrl's expansion code."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mrl.data.dataset import DataError, PromptDataset
from mrl.data.images import VisionSpec
from mrl.workers.minibatch import split_dynamic
from tests.helpers.tiny_vlm import png, save_vlm_files

SIZES = [(40, 60), (28, 28), (300, 20), (200, 180), (9, 13), (500, 400)]  # (width, height)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    save_vlm_files(d, request.param)
    return d


@pytest.fixture(scope="module")
def tok(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def _processor(ckpt):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(ckpt, backend="pil")  # the slow path: no torchvision here


def _hf_tokens(ckpt, pngs: list[bytes]) -> list[int]:
    """Image tokens per picture by transformers' processor: prod(image_grid_thw) / merge^2."""
    import io

    from PIL import Image

    proc = _processor(ckpt)
    grid = proc(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in pngs], return_tensors="pt")["image_grid_thw"]
    return [int(g.prod()) // proc.merge_size ** 2 for g in grid]


def _reference_ids(tok, text: str, counts: list[int]) -> list[int]:
    """The chat-templated prompt with each <image> written out as start + pad * n + end, tokenized."""
    parts = text.split("<image>")
    spelled = parts[0] + "".join(f"<|vision_start|>{'<|image_pad|>' * n}<|vision_end|>" + rest
                                 for n, rest in zip(counts, parts[1:]))
    rendered = tok.apply_chat_template([{"role": "user", "content": spelled}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def test_token_count_matches_the_image_processor(ckpt):
    spec = VisionSpec.from_checkpoint(ckpt)
    pngs = [png(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    assert [spec.tokens(h, w) for w, h in SIZES] == _hf_tokens(ckpt, pngs)


def _b64(data: bytes) -> dict:
    import base64

    return {"bytes": base64.b64encode(data).decode()}


def _row(text: str, images: list, gt: str = "1") -> dict:
    return {"prompt": [{"role": "user", "content": text}], "images": images, "data_source": "geo",
            "reward_model": {"ground_truth": gt}, "extra_info": {"i": 0}}


def test_verl_parquet_and_jsonl_rows(ckpt, tok, tmp_path):
    """Parquet with {"bytes"} entries (one and two pictures) and JSONL with a path and a file:// URL give the
    processor's number of image tokens in the trainer ids, one per picture in the engine ids."""
    a, b, c = png(40, 60, 1), png(200, 180, 2), png(300, 20, 3)
    texts = ["<image> What colour?", "Compare <image> and <image>.", "Plain text, no picture."]
    pq.write_table(pa.Table.from_pylist([_row(texts[0], [{"bytes": a, "path": None}]),
                                         _row(texts[1], [{"bytes": b, "path": None}, {"bytes": c, "path": None}]),
                                         _row(texts[2], [])]), tmp_path / "p.parquet")
    (tmp_path / "c.png").write_bytes(c)
    (tmp_path / "a.png").write_bytes(a)
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in [
        _row(texts[1], [str(tmp_path / "c.png"), f"file://{tmp_path / 'a.png'}"])]) + "\n")
    spec = VisionSpec.from_checkpoint(ckpt)
    ds = PromptDataset([tmp_path / "p.parquet", tmp_path / "p.jsonl"], tok, max_prompt_length=512, vision=spec)
    want = [_hf_tokens(ckpt, [a]), _hf_tokens(ckpt, [b, c]), [], _hf_tokens(ckpt, [c, a])]
    assert [p.image_tokens for p in ds.prompts] == want
    for p, text, counts in zip(ds.prompts, texts + [texts[1]], want):
        assert p.prompt_ids == _reference_ids(tok, text, counts)
        assert p.engine_prompt_ids == _reference_ids(tok, text, [1] * len(counts))
        assert p.prompt_ids.count(spec.image_token_id) == sum(counts)
    assert ds.prompts[1].images[1] == {"bytes": c, "path": None}
    # the collated trainer rows count image tokens: a token budget that holds the text alone splits them
    batch = ds.collate([0, 1, 3])
    lengths = batch.attention_mask.sum(1).tolist()
    assert lengths == [len(ds.prompts[i].prompt_ids) for i in (0, 1, 3)]
    text_only = [len(ds.prompts[i].engine_prompt_ids) for i in (0, 1, 3)]
    assert len(split_dynamic(text_only, sum(text_only))) == 1 < len(split_dynamic(lengths, sum(text_only)))


def test_image_tokens_count_in_max_prompt_length(ckpt, tok, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(_row("<image> hi", [_b64(png(500, 400))])) + "\n"
                 + json.dumps(_row("hi", [])) + "\n")
    spec = VisionSpec.from_checkpoint(ckpt)
    text_len = len(PromptDataset([f], tok, vision=spec).prompts[0].engine_prompt_ids)
    ds = PromptDataset([f], tok, max_prompt_length=text_len + 1, vision=spec)  # the text fits, its 16 image tokens do not
    assert ds.num_filtered == 1 and len(ds) == 1
    with pytest.raises(DataError, match=r"p.jsonl:1: prompt has \d+ tokens > data.max_prompt_length"):
        PromptDataset([f], tok, max_prompt_length=text_len + 1, vision=spec, filter_overlong_prompts=False)


BAD = [
    ("unreadable", lambda d: _row("<image> x", [_b64(b"\x89PNG not really")]), "image 1 of 1: the image bytes are not a readable picture"),
    ("missing file", lambda d: _row("<image> x", [str(d / "nope.png")]), "image 1 of 1: image file .*nope.png' does not exist"),
    ("more placeholders", lambda d: _row("<image> and <image>", [_b64(png(30, 30))]), r"2 <image> placeholder\(s\) but the row has 1 image\(s\) \(more placeholders than images\)"),
    ("more images", lambda d: _row("<image>", [_b64(png(30, 30)), _b64(png(30, 30))]), "more images than placeholders"),
    ("far over max_pixels", lambda d: _row("<image>", [_b64(png(1200, 1000))]), "image 1 of 1: the image is 1200x1000 = 1200000 pixels, over 16 x"),
    ("remote url", lambda d: _row("<image>", ["https://example.com/a.png"]), "remote URL"),
]


@pytest.mark.parametrize("name,make,match", BAD, ids=[b[0] for b in BAD])
def test_bad_images_refused_with_the_row_or_dropped_with_a_count(ckpt, tok, tmp_path, name, make, match):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(_row("<image> fine", [_b64(png(30, 30))])) + "\n" + json.dumps(make(tmp_path)) + "\n")
    spec = VisionSpec.from_checkpoint(ckpt)
    with pytest.raises(DataError, match=rf"p.jsonl:2: column 'images' \(data.image_key\): .*{match}.*data.filter_bad_images=true"):
        PromptDataset([f], tok, vision=spec)
    ds = PromptDataset([f], tok, vision=spec, filter_bad_images=True)
    assert (len(ds), ds.num_bad_images) == (1, 1)


def test_images_for_a_text_model_and_a_custom_image_key(ckpt, tok, tmp_path):
    f = tmp_path / "p.jsonl"
    row = _row("<image> x", [])
    row["pics"] = [_b64(png(30, 30))]
    f.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"p.jsonl:1: .*'pics' \(data.image_key\) holds 1 image\(s\), but model.path is a text-only"):
        PromptDataset([f], tok, image_key="pics")
    spec = VisionSpec.from_checkpoint(ckpt)
    assert PromptDataset([f], tok, image_key="pics", vision=spec).prompts[0].image_tokens == _hf_tokens(ckpt, [png(30, 30)])


def test_text_checkpoint_has_no_vision_spec(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    assert VisionSpec.from_checkpoint(tmp_path) is None

