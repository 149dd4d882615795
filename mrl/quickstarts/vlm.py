"""The vision-language quickstart's assets, locally: ``python -m mrl.quickstarts vlm``.

A task only the picture answers: each prompt is ``"<image> what colour is the square ? answer:"`` and its picture
a 56 x 56 grey canvas with one square of a random size and place, filled with one of :data:`COLOURS` (each
channel jittered by up to ±:data:`JITTER`); the ground truth is the colour's name, scored by ``exact_match``. The
text is the same for every row, so a policy that does not read the picture cannot beat the most common colour's
share (1/4 on the balanced val split).

* ``<out>/tiny-qwen2_5_vl/``: a tiny **Qwen2.5-VL** (``Qwen2_5_VLForConditionalGeneration``): decoder hidden 64,
  4 layers, 4 heads / 2 KV heads of 16, mRoPE sections (2, 3, 3); a one-block vision tower (patch 14, 2x2 merge,
  hidden 32) whose output replaces the picture's 4 image tokens (56 x 56 pixels = 4 x 4 patches). A byte-level BPE
  tokenizer of 300 entries trained here with Qwen's vision special tokens; ``preprocessor_config.json`` fixes every
  picture at 56 x 56 (min_pixels = max_pixels).
* A **format-only warm start**: :data:`WARM_START_STEPS` supervised steps (decoder only; the vision tower stays at
  its random init, frozen as in RL) on ``prompt + " <colour></s>"`` with the colour drawn *at random* for every
  example, not read from the picture. The model learns to answer with one of the four names, and nothing that ties
  the answer to the pixels, so greedy val starts near 1/4; GRPO has to learn to look.
* ``<out>/data/train.jsonl`` (:data:`N_TRAIN` rows) and ``val.jsonl`` (:data:`N_VAL`, balanced colours, other
  pictures than train's): verl's multimodal rows (``prompt``, ``images`` = [{"bytes": base64 PNG}],
  ``reward_model.ground_truth``). ``--blank`` writes the same rows with every picture replaced by the empty grey
  canvas: the control that shows the task needs the picture.

Everything follows from ``--seed`` (one thread in the warm start). An asset already present is kept unless
``--force``.
"""
from __future__ import annotations

import base64
import io
import json
import random
import shutil
from pathlib import Path

from mrl.quickstarts.cli import Demo

OUT = "outputs/quickstart_vlm"
MODEL_DIR = "tiny-qwen2_5_vl"
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 70, 230), "yellow": (230, 210, 40)}
GREY, SIDE, JITTER = (128, 128, 128), 56, 25
PROMPT = "<image> what colour is the square ? answer:"
N_TRAIN, N_VAL = 256, 64
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB_SIZE = 300
WARM_START_STEPS, WARM_START_BATCH, WARM_START_LR = 60, 32, 3e-3
TEXT = {"vocab_size": VOCAB_SIZE, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
          "fullatt_block_indexes": [0], "in_chans": 3}


def picture(colour: str | None, rng: random.Random) -> bytes:
    """A PNG: the grey canvas with one square of ``colour`` (None: no square, the blank control)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE), GREY)
    if colour is not None:
        side = rng.randint(14, 36)
        x, y = rng.randint(0, SIDE - side), rng.randint(0, SIDE - side)
        fill = tuple(max(0, min(255, c + rng.randint(-JITTER, JITTER))) for c in COLOURS[colour])
        ImageDraw.Draw(img).rectangle([x, y, x + side - 1, y + side - 1], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def rows(n: int, rng: random.Random, blank: bool = False) -> list[tuple[bytes, str]]:
    """``n`` (picture, colour) pairs, the colours balanced (n/4 each) in shuffled order."""
    names = [c for _ in range(-(-n // len(COLOURS))) for c in COLOURS][:n]
    rng.shuffle(names)
    return [(picture(None if blank else c, rng), c) for c in names]


def build_tokenizer():
    """Byte-level BPE of exactly VOCAB_SIZE entries on the task's text, with Qwen's vision special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [PROMPT.replace("<image>", "") + f" {c}" for c in COLOURS] * 4 + ["the colour of the picture"]
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def config():
    from transformers import Qwen2_5_VLConfig

    ids = {s: i for i, s in enumerate(SPECIALS)}
    cfg = Qwen2_5_VLConfig(text_config={**TEXT, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
                           vision_config=VISION, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    return cfg


def _encode(tok, processor, data: list[tuple[bytes, str]]):
    """(prompt ids with the picture's image tokens, pixel_values, image_grid_thw) per row, as the trainer reads it."""
    from PIL import Image

    start, pad, end = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
    out = []
    for png, _ in data:
        px = processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="pt")
        n = int(px["image_grid_thw"].prod()) // VISION["spatial_merge_size"] ** 2
        ids = tok(PROMPT.replace("<image>", start + pad * n + end), add_special_tokens=False)["input_ids"]
        out.append((ids, px["pixel_values"], px["image_grid_thw"]))
    return out


def greedy_accuracy(model, tok, processor, data: list[tuple[bytes, str]]) -> float:
    """Fraction of ``data`` whose greedy answer is exactly the colour (the ``exact_match`` rule)."""
    import torch

    from mrl.rewards.scorers import exact_match

    right = 0
    with torch.no_grad():
        for (ids, px, grid), (_, colour) in zip(_encode(tok, processor, data), data, strict=True):
            out = model.generate(input_ids=torch.tensor([ids]), pixel_values=px, image_grid_thw=grid,
                                 max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=2)
            right += exact_match(tok.decode(out[0, len(ids):], skip_special_tokens=True), colour)
    return right / len(data)


def warm_start(model, tok, processor, data: list[tuple[bytes, str]], seed: int, steps: int) -> None:
    """The format-only warm start in place (module docstring): AdamW on the decoder's parameters, the loss the mean
    cross-entropy of the answer tokens ``" <colour></s>"`` with the colour drawn uniformly at random per example::

        L = -1/|A| sum_{t in A} log p(x_t | x_<t, picture),   A = positions of " <random colour></s>"
    """
    import torch

    rng = random.Random(seed)
    enc = _encode(tok, processor, data)
    answers = {c: tok(f" {c}", add_special_tokens=False)["input_ids"] + [2] for c in COLOURS}
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=WARM_START_LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model.train()
        for _ in range(steps):
            batch = [rng.choice(enc) for _ in range(WARM_START_BATCH)]
            seqs = [(ids, ids + answers[rng.choice(list(COLOURS))]) for ids, _, _ in batch]
            L = max(len(s) for _, s in seqs)
            ids = torch.zeros(len(seqs), L, dtype=torch.long)
            target = torch.zeros_like(ids, dtype=torch.bool)
            for i, (p, s) in enumerate(seqs):
                ids[i, :len(s)] = torch.tensor(s)
                target[i, len(p):len(s)] = True
            logits = model(input_ids=ids, attention_mask=(ids != 0).long(),  # right padding (<pad> = 0) masked
                           pixel_values=torch.cat([b[1] for b in batch]),
                           image_grid_thw=torch.cat([b[2] for b in batch])).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = nll[target[:, 1:]].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        model.eval()
    finally:
        torch.set_num_threads(threads)
    for p in model.model.visual.parameters():
        p.requires_grad_(True)


def _preprocessor(path: Path) -> None:
    px = SIDE * SIDE  # every picture stays 56 x 56: 4 x 4 patches of 14, 4 tokens after the 2 x 2 merge
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": VISION["patch_size"],
        "merge_size": VISION["spatial_merge_size"], "temporal_patch_size": VISION["temporal_patch_size"],
        "min_pixels": px, "max_pixels": px, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_rescale": True, "do_normalize": True, "do_resize": True, "do_convert_rgb": True}, indent=2))


def write_model(path: Path, seed: int, steps: int) -> float:
    """Tokenizer, image-processor settings and the warm-started model in ``path``; returns its greedy val accuracy."""
    import torch
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        PreTrainedTokenizerFast,
        Qwen2_5_VLForConditionalGeneration,
    )

    path.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", additional_special_tokens=SPECIALS[4:],
                            model_max_length=TEXT["max_position_embeddings"]).save_pretrained(str(path))
    _preprocessor(path)
    cfg = config()
    cfg.save_pretrained(str(path))
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path))  # as the trainer and engines load it
    processor = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    rng = random.Random(seed + 1)
    if steps > 0:
        warm_start(model, tok, processor, rows(N_TRAIN, rng), seed, steps)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(path), safe_serialization=True)
    return greedy_accuracy(model.eval(), tok, processor, rows(N_VAL, random.Random(seed + 2)))


def _row(png: bytes, colour: str, split: str, i: int) -> str:
    return json.dumps({"data_source": "colour", "prompt": PROMPT, "images": [{"bytes": base64.b64encode(png).decode()}],
                       "reward_model": {"ground_truth": colour, "style": "rule"},
                       "extra_info": {"split": split, "index": i}})


def write_data(data_dir: Path, seed: int, blank: bool) -> None:
    """train.jsonl and val.jsonl (module docstring); ``blank``: every picture without its square."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, n, s in (("train", N_TRAIN, seed + 1), ("val", N_VAL, seed + 2)):
        lines = [_row(png, c, split, i) for i, (png, c) in enumerate(rows(n, random.Random(s), blank))]
        (data_dir / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _add_arguments(p) -> None:
    p.add_argument("--warm-start-steps", type=int, default=WARM_START_STEPS,
                   help=f"format-only supervised steps (default {WARM_START_STEPS}; 0: random weights)")
    p.add_argument("--blank", action="store_true",
                   help="write the data with every picture blanked (the control: the task then cannot be learnt)")


def write(args) -> dict[str, str]:
    from mrl.quickstarts.cli import UsageError

    if args.warm_start_steps < 0:
        raise UsageError("--warm-start-steps must be >= 0")
    out = Path(args.out)
    model_dir, data_dir = out / MODEL_DIR, out / ("data_blank" if args.blank else "data")
    status = {}
    if args.force or not (model_dir / "model.safetensors").is_file():
        shutil.rmtree(model_dir, ignore_errors=True)
        acc = write_model(model_dir, args.seed, args.warm_start_steps)
        status[str(model_dir)] = f"written (format-only warm start: greedy val accuracy {acc:.2f})"
    else:
        status[str(model_dir)] = "kept"
    if args.force or not (data_dir / "val.jsonl").is_file():
        write_data(data_dir, args.seed, args.blank)
        status[str(data_dir)] = "written"
    else:
        status[str(data_dir)] = "kept"
    return status


DEMO = Demo("vlm", "the vision-language quickstart: a tiny Qwen2.5-VL and a colour task only the picture answers",
            OUT, 0, _add_arguments, write)
