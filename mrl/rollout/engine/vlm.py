"""Vision-language models in the embedded engine (Qwen2.5-VL, Qwen3-VL): SGLang's ``image_data`` in,
transformers' own forward with the pictures out.

A request holds ``input_ids`` with one image token (``<|image_pad|>``) per picture and ``image_data`` with
the pictures in the same order, as SGLang takes them (base64 strings, ``data:`` URLs, paths, ``file://``
URLs). :meth:`VisionProcessor.prepare` runs the checkpoint's image processor (transformers' PIL backend: no
torchvision) and repeats each image token ``prod(image_grid_thw) / merge^2`` times, SGLang's expansion, so
the request's ``prompt_ids`` are what the model sees and what the trainer scores.

Prefill (:func:`prefill_inputs`): the rows' pictures are concatenated in row order (``pixel_values``
``[patches, C*T*P*P]``, ``image_grid_thw`` ``[pictures, 3]``) and the multimodal RoPE positions are the
model's own ``get_rope_index`` over the left-padded batch (``[3, n, L]``: a picture's tokens take
(t, h, w) grid positions, text tokens one position for all three). Text after the prompt continues from
``max(position) + 1`` in all three sections, so a row's next position is that value and a decode step is
the usual ``[B, 1]`` forward whose 2-D positions the model spreads over the three sections.

Rows are deduplicated by (ids, pictures), never by ids alone: two prompts with the same text and other
pictures are two prefills.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mrl.data.images import ImageError, expand_image_tokens, open_image


def is_vision_language(config: Any) -> bool:
    """A checkpoint whose config has a vision tower and an image token (Qwen-VL's layout)."""
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def load_model(path: str | Path, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The checkpoint's transformers model: ``*ForConditionalGeneration`` for a vision-language one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=dtype)


@dataclass(frozen=True)
class VisionInputs:
    """One prompt's pictures, processed: ``pixel_values`` [patches, C*T*P*P], ``grid_thw`` [pictures, 3],
    and a digest of the pictures (the prefill's deduplication key)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    digest: str


def _engine_ref(item: Any) -> Any:
    """An ``image_data`` item as mrl.data.images reads it: SGLang takes a plain string that is no path (nor
    URL) as base64 of the encoded picture."""
    if not isinstance(item, str):
        raise ImageError(f"an image_data item is a {type(item).__name__}; send a base64 string, a data: URL or a path")
    if item.startswith(("data:", "file://")) or "://" in item or _is_file(item):
        return item
    return {"bytes": item}


def _is_file(s: str) -> bool:
    try:
        return Path(s).is_file()
    except (OSError, ValueError):  # a base64 string is no file name (too long, or a NUL)
        return False


class VisionProcessor:
    """The checkpoint's image processor and image token (see the module docstring)."""

    def __init__(self, model_path: str | Path, config: Any) -> None:
        from transformers import AutoImageProcessor

        if not (Path(model_path) / "preprocessor_config.json").is_file():
            raise FileNotFoundError(f"--model {model_path}: a vision-language checkpoint without "
                                    "preprocessor_config.json (its image processor); copy it from the model's release")
        self.processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")
        self.image_token_id = int(config.image_token_id)
        self.merge = int(config.vision_config.spatial_merge_size)

    def prepare(self, ids: list[int], image_data: list[Any]) -> tuple[list[int], VisionInputs | None]:
        """(expanded ids, pictures) of one request; ValueError (HTTP 400) for a picture that cannot be read or
        a number of image tokens other than the number of pictures."""
        if not image_data:
            if self.image_token_id in ids:
                raise ValueError(f"input_ids hold {ids.count(self.image_token_id)} image token(s) "
                                 f"(id {self.image_token_id}) but the request has no image_data")
            return list(ids), None
        images = []
        for k, item in enumerate(image_data):
            try:
                images.append(open_image(_engine_ref(item)))
            except ImageError as e:
                raise ValueError(f"image_data[{k}]: {e}") from None
        out = self.processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"].long()
        counts = (grid.prod(-1) // self.merge ** 2).tolist()
        try:
            expanded = expand_image_tokens(ids, self.image_token_id, counts)
        except ValueError as e:
            raise ValueError(f"input_ids / image_data: {e}; send one image token (id {self.image_token_id}) per "
                             "picture, in order (the engine expands it)") from None
        h = hashlib.sha256()
        for img in images:
            h.update(repr(img.size).encode())
            h.update(img.tobytes())
        return expanded, VisionInputs(out["pixel_values"], grid, h.hexdigest())


def prefill_inputs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, vision: list[VisionInputs | None],
                   image_token_id: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(position_ids [3, n, L], next position of each row [n], extra forward kwargs) of a left-padded prefill
    of ``n`` rows whose pictures are ``vision`` (row order; None = none)."""
    dev = ids.device
    rows = [v for v in vision if v is not None]
    grid = torch.cat([v.grid_thw for v in rows]).to(dev) if rows else None
    mm_types = (ids == image_token_id).int()  # transformers' mm_token_type_ids: 1 = image, 0 = text
    pos, _ = model.model.get_rope_index(ids, mm_types, image_grid_thw=grid, attention_mask=mask)
    next_pos = (pos.amax(dim=(0, 2)) + 1).cpu()  # text after the prompt: max position + 1, all sections
    kw: dict[str, Any] = {"mm_token_type_ids": mm_types}
    if rows:
        dtype = next(model.parameters()).dtype
        kw["pixel_values"] = torch.cat([v.pixel_values for v in rows]).to(dev, dtype)
        kw["image_grid_thw"] = grid
    return pos, next_pos, kw
