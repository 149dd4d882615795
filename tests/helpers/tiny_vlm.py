"""Tiny vision-language checkpoints and images, built locally (no downloads).

``save_tiny_vlm(path, kind)`` writes a random Qwen2.5-VL (``kind="qwen2_5_vl"``), Qwen3-VL (``"qwen3_vl"``),
Qwen3-VL-MoE (``"qwen3_vl_moe"``) or Qwen3.5 (``"qwen3_5"``: Gated DeltaNet + gated attention layers, interleaved
mRoPE on a quarter of each head) checkpoint with a byte-level BPE tokenizer carrying Qwen's vision special tokens, a
ChatML chat template and a ``preprocessor_config.json`` for Qwen's image processor (small ``max_pixels``
so a test image becomes a handful of tokens). ``png(w, h, seed)`` is an in-memory PNG.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB = 256 + len(SPECIALS)  # byte symbols (no merges) + specials: ids 0..6 are the specials
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16, "qwen3_vl_moe": 16, "qwen3_5": 16}
MIN_PIXELS_TOKENS, MAX_PIXELS_TOKENS = 1, 16  # merged tokens per image at least / at most


def save_tokenizer(path: str | Path) -> dict[str, int]:
    """The tokenizer (Qwen's special tokens, ChatML template) into ``path``; returns {special: id}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["a"], trainer=trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.save_pretrained(str(path))
    cfg_path = Path(path) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "TokenizersBackend"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return {s: tok.token_to_id(s) for s in SPECIALS}


def save_vlm_files(path: str | Path, kind: str = "qwen2_5_vl"):
    """Everything of a tiny ``kind`` checkpoint but its weights (tokenizer, config.json,
    preprocessor_config.json) into ``path``; returns (config, model class)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ids = save_tokenizer(path)
    tokens = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}
    text = {"vocab_size": VOCAB + 8, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
                "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None,
                "tie_word_embeddings": False}
    if kind == "qwen2_5_vl":
        cfg = Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": [2, 1, 1]}},
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                               "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                               "fullatt_block_indexes": [1], "in_chans": 3},
            **tokens)
        model_cls = Qwen2_5_VLForConditionalGeneration
    elif kind == "qwen3_vl":
        cfg = Qwen3VLConfig(
            text_config={**text, "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                    "mrope_section": [2, 1, 1],
                                                                    "mrope_interleaved": True}},
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                               "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                               "deepstack_visual_indexes": [0], "in_channels": 3},
            **tokens)
        model_cls = Qwen3VLForConditionalGeneration
    elif kind == "qwen3_vl_moe":  # Qwen3-VL's tower before a Qwen3-MoE decoder: 4 experts, top-2
        cfg = Qwen3VLMoeConfig(
            text_config={**text, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                         "mlp_only_layers": [], "router_aux_loss_coef": 0.0,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                             "mrope_interleaved": True}},
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                               "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
                               "deepstack_visual_indexes": [0], "in_channels": 3},
            **tokens)
        model_cls = Qwen3VLMoeForConditionalGeneration
    elif kind == "qwen3_5":
        # head_dim 32 with partial_rotary_factor 0.25: 8 rotated channels, 4 frequencies = mrope_section's 2 + 1 + 1
        cfg = Qwen3_5Config(
            text_config={**text, "head_dim": 32, "layer_types": ["linear_attention", "full_attention"],
                         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                         "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                             "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                           "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                           "num_position_embeddings": 64, "in_channels": 3},
            tie_word_embeddings=False, **tokens)
        model_cls = Qwen3_5ForConditionalGeneration
    else:
        raise ValueError(f"kind must be qwen2_5_vl, qwen3_vl, qwen3_vl_moe or qwen3_5, got {kind!r}")
    cfg.architectures = [model_cls.__name__]
    cfg.save_pretrained(str(path))
    px = (PATCH[kind] * 2) ** 2  # pixels of one merged token
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH[kind], "merge_size": 2,
        "temporal_patch_size": 2, "min_pixels": MIN_PIXELS_TOKENS * px, "max_pixels": MAX_PIXELS_TOKENS * px,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True, "do_normalize": True,
        "do_resize": True, "do_convert_rgb": True}, indent=2))
    return cfg, model_cls


def save_tiny_vlm(path: str | Path, kind: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """A random tiny ``kind`` checkpoint (fp32) with tokenizer and image-processor config in ``path``."""
    import torch

    cfg, model_cls = save_vlm_files(path, kind)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    model.save_pretrained(str(path))
    if kind == "qwen3_vl_moe":  # the released files' x @ W experts (transformers 5 saves its modules' transposes)
        from safetensors.torch import load_file, save_file

        f = Path(path) / "model.safetensors"
        sd = load_file(str(f))
        save_file({n: t.transpose(1, 2).contiguous() if ".mlp.experts." in n else t for n, t in sd.items()}, str(f),
                  metadata={"format": "pt"})
    return Path(path)


def png(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    """An in-memory PNG of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    chans = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, size=(height, width, chans) if chans > 1 else (height, width), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def picture_inputs(path: str | Path, sizes: list[tuple[int, int]], seed: int = 0) -> dict:
    """``{"pixel_values", "image_grid_thw"}`` of random pictures of ``sizes`` (w, h) through the checkpoint's own image
    processor (transformers' PIL backend), ``{}`` for no pictures."""
    import io as _io

    import torch
    from PIL import Image
    from transformers import AutoImageProcessor

    if not sizes:
        return {}
    proc = AutoImageProcessor.from_pretrained(str(path), backend="pil")
    images = [Image.open(_io.BytesIO(png(w, h, seed=seed + k))) for k, (w, h) in enumerate(sizes)]
    out = proc(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"].to(torch.float32), "image_grid_thw": out["image_grid_thw"].long()}


def vlm_prompt(cfg, pictures: dict, text: list[int], merge: int = 2) -> list[int]:
    """Token ids ``text[0] <vision_start> <image_pad>·n_1 <vision_end> text[1] ...`` with one text run per picture plus
    a last one (``text`` holds runs of ids, len(text) = pictures + 1), each picture expanded to its merged tokens."""
    grids = pictures.get("image_grid_thw") if pictures else None
    n = 0 if grids is None else len(grids)
    if len(text) != n + 1:
        raise ValueError(f"{n} pictures need {n + 1} text runs, got {len(text)}")
    ids: list[int] = list(text[0])
    for k in range(n):
        t, h, w = (int(x) for x in grids[k])
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // merge ** 2) + [cfg.vision_end_token_id]
        ids += list(text[k + 1])
    return ids


# (picture sizes (w, h), prompt text runs, response length) of vlm_batch's samples: one picture with h' != w' (the
# h and w axes of the 3-D positions differ), two pictures, none, one more after a longer text
VLM_SAMPLES = (
    ([(56, 84)], [[10, 11, 12], [20, 21]], 3),
    ([(56, 84), (40, 30)], [[13], [22, 23], [30, 31, 32]], 2),
    ([], [[40, 41, 42, 43, 44]], 4),
    ([(84, 56)], [[50, 51, 52, 53], [60]], 1),
)


def vlm_batch(path: str | Path, seed: int = 0):
    """A ragged TrainBatch of :data:`VLM_SAMPLES` (prompts left-padded, responses right-padded, ``multi_modal`` as
    the image processor returns it) for the checkpoint at ``path``."""
    import torch
    from transformers import AutoConfig

    from mrl.workers.batch import TrainBatch

    cfg = AutoConfig.from_pretrained(str(path))
    g = torch.Generator().manual_seed(seed)
    prompts, responses, mm = [], [], []
    for k, (sizes, text, r) in enumerate(VLM_SAMPLES):
        pics = picture_inputs(path, sizes, seed=seed + 10 * k)
        prompts.append(vlm_prompt(cfg, pics, text))
        responses.append(torch.randint(70, 200, (r,), generator=g).tolist())
        mm.append(pics)
    B, P, R = len(prompts), max(map(len, prompts)), max(map(len, responses))
    ids = torch.zeros(B, P + R, dtype=torch.long)
    am = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P], ids[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        am[i, P - len(p):P + len(r)] = 1
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    return TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, P:].clone(),
                      response_mask=am[:, P:].clone(), advantages=torch.randn(B, R, generator=g) * am[:, P:],
                      multi_modal=mm)


def hf_vlm_logits(model, batch) -> list:
    """Each sample's logits [n_i, V] by transformers' own forward on its valid tokens with its pictures (the model in
    whatever dtype it holds)."""

    out = []
    cfg = model.config
    for i in range(batch.batch_size):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()][None]
        pics = batch.multi_modal[i]
        kw = {}
        if pics:
            kw = {"pixel_values": pics["pixel_values"].to(model.dtype), "image_grid_thw": pics["image_grid_thw"],
                  "mm_token_type_ids": (ids == cfg.image_token_id).int()}
        out.append(model(input_ids=ids, **kw).logits[0])
    return out
