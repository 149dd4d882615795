"""``python -m mrl.quickstarts vlm``: a colour task only the picture answers. Each row's picture holds one square of
its ground-truth colour (read back from the PNG), the val pictures are not train's, the colours are balanced, the
--blank control has no square at all, and the format-only warm start answers with colour names at chance."""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np

from mrl.quickstarts import vlm
from mrl.quickstarts.cli import main as quickstarts_main
from tests.helpers.e2e import write_vlm_assets


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _square(row: dict) -> np.ndarray:
    """The pixels of the row's picture that are not the grey canvas."""
    from PIL import Image

    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(row["images"][0]["bytes"]))).convert("RGB")).astype(int)
    return img[(img != vlm.GREY).any(-1)]


def test_each_picture_shows_its_answer_and_val_is_held_out(tmp_path: Path) -> None:
    assert quickstarts_main(["vlm", "--out", str(tmp_path), "--warm-start-steps", "0"]) == 0
    train, val = _rows(tmp_path / "data" / "train.jsonl"), _rows(tmp_path / "data" / "val.jsonl")
    assert (len(train), len(val)) == (vlm.N_TRAIN, vlm.N_VAL)
    names = list(vlm.COLOURS)
    for rows in (train, val):
        truth = [r["reward_model"]["ground_truth"] for r in rows]
        assert {c: truth.count(c) for c in names} == {c: len(rows) // 4 for c in names}  # chance = 1/4
        for r in rows:
            assert r["prompt"] == vlm.PROMPT and len(r["images"]) == 1
            px = _square(r)
            assert len(px) >= 14 * 14  # the smallest square
            nearest = min(names, key=lambda c: np.abs(px.mean(0) - vlm.COLOURS[c]).sum())
            assert nearest == r["reward_model"]["ground_truth"]
    assert not {r["images"][0]["bytes"] for r in train} & {r["images"][0]["bytes"] for r in val}
    assert quickstarts_main(["vlm", "--out", str(tmp_path), "--blank"]) == 0
    blank = _rows(tmp_path / "data_blank" / "train.jsonl")
    assert [r["reward_model"] for r in blank] == [r["reward_model"] for r in train]
    assert all(len(_square(r)) == 0 for r in blank)


def test_the_warm_start_teaches_the_answer_format_not_the_task(tmp_path: Path) -> None:
    import random

    import torch
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
    )

    model_dir = write_vlm_assets(tmp_path / "assets") / vlm.MODEL_DIR
    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = vlm.rows(vlm.N_VAL, random.Random(2))
    answers = []
    with torch.no_grad():
        for ids, px, grid in vlm._encode(tok, proc, data):
            out = model.generate(input_ids=torch.tensor([ids]), pixel_values=px, image_grid_thw=grid, max_new_tokens=6,
                                 do_sample=False, pad_token_id=0, eos_token_id=2)
            answers.append(tok.decode(out[0, len(ids):], skip_special_tokens=True).strip())
    assert set(answers) <= set(vlm.COLOURS), answers  # the format is learnt ...
    right = sum(a == c for a, (_, c) in zip(answers, data, strict=True)) / len(data)
    assert right <= 0.3, right  # ... the task is not (chance 1/4: the labels it saw were random)
