"""The step's two views of a prompt with pictures (mrl/driver/vision.py): what the engine is sent (engine ids +
SGLang's image_data) and what the trainer reads (expanded ids + the processor's pixels) describe the same
sequence and the same pixels — checked by running the engine's own expansion on the request."""
import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mrl.data.dataset import PromptDataset
from mrl.data.images import VisionSpec
from mrl.driver.batch import assemble_train_batch
from mrl.driver.vision import Pictures, request_inputs
from mrl.rollout.types import RolloutResult, RolloutSample
from tests.helpers.tiny_vlm import png, save_vlm_files


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vlm")
    save_vlm_files(path, "qwen2_5_vl")  # no weights: only the tokenizer and the image processor are read
    return path


@pytest.fixture(scope="module")
def prompts(ckpt, tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("data")
    pics = [png(40, 60, 1), png(200, 180, 2), png(300, 20, 3)]
    rows = [("<image> What colour?", [pics[0]]), ("Plain text.", []), ("Compare <image> and <image>.", pics[1:])]
    (d / "p.jsonl").write_text("\n".join(json.dumps({
        "prompt": [{"role": "user", "content": t}], "images": [{"bytes": base64.b64encode(p).decode()} for p in ps],
        "reward_model": {"ground_truth": "1"}}) for t, ps in rows) + "\n")
    ds = PromptDataset([d / "p.jsonl"], AutoTokenizer.from_pretrained(ckpt), max_prompt_length=512,
                       vision=VisionSpec.from_checkpoint(ckpt))
    return ds, pics


def _pixels(data: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_the_engine_request_expands_to_the_trainer_ids_and_pixels(ckpt, prompts) -> None:
    from transformers import AutoConfig

    from mrl.rollout.engine.vlm import VisionProcessor

    ds, pics = prompts
    ids, image_data = request_inputs(ds.prompts)
    assert ids == [ds.prompts[0].engine_prompt_ids, ds.prompts[1].prompt_ids, ds.prompts[2].engine_prompt_ids]
    assert [len(x) for x in image_data] == [1, 0, 2]
    # the pictures travel losslessly (PNG), in the row's order
    sent = [image_data[0][0], *image_data[2]]
    for b64, orig in zip(sent, pics, strict=True):
        assert np.array_equal(_pixels(base64.b64decode(b64)), _pixels(orig))
    # what the engine does with the request (SGLang's expansion) is exactly what the trainer reads
    engine = VisionProcessor(ckpt, AutoConfig.from_pretrained(ckpt))
    inputs = Pictures(ckpt, VisionSpec.from_checkpoint(ckpt)).model_inputs(ds.prompts)
    assert inputs[1] == {}
    for k in (0, 2):
        expanded, vis = engine.prepare(ids[k], image_data[k])
        assert expanded == ds.prompts[k].prompt_ids
        assert torch.equal(inputs[k]["image_grid_thw"], vis.grid_thw)
        assert torch.equal(inputs[k]["pixel_values"], vis.pixel_values.float())
    assert inputs[2]["image_grid_thw"].shape == (2, 3)
    # a text-only request is unchanged: the trainer ids, no image_data
    assert request_inputs([ds.prompts[1]]) == ([ds.prompts[1].prompt_ids], None)


def test_a_token_count_the_processor_disagrees_with_names_the_row(ckpt, prompts) -> None:
    import dataclasses

    ds, _ = prompts
    bad = dataclasses.replace(ds.prompts[2], image_tokens=[ds.prompts[2].image_tokens[0] + 1, ds.prompts[2].image_tokens[1]])
    with pytest.raises(ValueError, match=r"p\.jsonl:3: the image processor makes \[\d+, \d+\] image tokens"):
        Pictures(ckpt, VisionSpec.from_checkpoint(ckpt)).model_inputs([ds.prompts[0], bad])


def test_each_sample_carries_its_prompts_pictures(prompts) -> None:
    ds, _ = prompts
    pb = ds.collate([0, 1, 2])
    n = 2
    samples = [RolloutSample(i, j, [], [5, 6][: 1 + j], [-0.5, -0.25][: 1 + j], "stop") for i in range(3) for j in range(n)]
    entries = [{"pixel_values": torch.full((4, 1), float(i))} if i != 1 else {} for i in range(3)]
    batch = assemble_train_batch(pb, RolloutResult(samples, n=n), pad_token_id=0, uids=[0, 1, 2], multi_modal=entries)
    assert [e.get("pixel_values", torch.tensor([-1.0]))[0].item() for e in batch.multi_modal] == [0, 0, -1, -1, 2, 2]
    with pytest.raises(ValueError, match="2 multi_modal entries for 3 prompts"):
        assemble_train_batch(pb, RolloutResult(samples, n=n), pad_token_id=0, uids=[0, 1, 2], multi_modal=entries[:2])
