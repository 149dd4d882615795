"""Images of vision-language prompts: reading them, checking them, and the image tokens they become.

A prompt row (verl's multimodal parquet, or the same fields in JSONL) holds chat messages whose text
contains one ``<image>`` per picture and a column (``data.image_key``, default ``images``) with the
pictures in order: each one raw bytes, ``{"bytes": ..., "path": ...}`` (what ``datasets.Image`` writes
to parquet; in JSON ``bytes`` is a base64 string), a file path, a ``file://`` URL or a base64 ``data:`` URL.
Relative paths are read from the current directory.

Qwen-VL's image tokens (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; the rule of their image processor): a picture of
``h x w`` pixels is resized to ``h' x w'``, multiples of ``f = patch_size * merge_size``::

    h' = f * round(h / f),  w' = f * round(w / f)                       (nearest multiples)
    if h' * w' > max_pixels:  b = sqrt(h * w / max_pixels);  h' = max(f, f * floor(h / b / f)), same for w'
    if h' * w' < min_pixels:  b = sqrt(min_pixels / (h * w)); h' = f * ceil(h * b / f),          same for w'

and becomes ``(h' / patch) * (w' / patch)`` patches, ``(h' * w') / f^2`` tokens after the 2x2 merge
(``image_grid_thw = [1, h'/patch, w'/patch]``). The prompt text puts ``<|vision_start|><|image_pad|>
<|vision_end|>`` where ``<image>`` was; the *engine* prompt keeps one ``<|image_pad|>`` per picture (SGLang
expands it from ``image_data``), the *trainer* prompt repeats it once per image token.

A picture whose pixel count is over ``FAR_OVER`` x ``max_pixels`` is refused: the processor would shrink
it by more than 4x per side, so nearly all of what is decoded is thrown away, and such files are mostly
the wrong file (a scan, a raw photo). So is an aspect ratio over ``MAX_ASPECT`` (the processor's own limit).
"""
from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
FAR_OVER = 16  # pixels over this many times max_pixels: refused (see the module docstring)
MAX_ASPECT = 200  # Qwen-VL's image processor refuses longer/shorter side ratios above this


class ImageError(ValueError):
    """One picture that cannot be used; the message says why (the caller adds file:row and the fix)."""


@dataclass(frozen=True)
class VisionSpec:
    """What a vision-language checkpoint fixes about its pictures: the special token ids (``config.json``)
    and the resize rule of its image processor (``preprocessor_config.json``)."""

    image_token_id: int
    vision_start_id: int
    vision_end_id: int
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    model_type: str = ""

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> VisionSpec | None:
        """From ``path/config.json`` and ``path/preprocessor_config.json``; None when the checkpoint has no
        ``vision_config`` (a text model). ValueError names the file and what it lacks."""
        p = Path(path)
        cfg = json.loads((p / "config.json").read_text())
        if not isinstance(cfg, dict) or "vision_config" not in cfg:
            return None
        pre_file = p / "preprocessor_config.json"
        if not pre_file.is_file():
            raise ValueError(f"{p} is a vision-language checkpoint without preprocessor_config.json (its image "
                             "processor's settings); fix: copy preprocessor_config.json from the model's release")
        pre = json.loads(pre_file.read_text())
        size = pre.get("size") or {}
        vis = cfg["vision_config"]
        try:
            return cls(
                image_token_id=int(cfg["image_token_id"]), vision_start_id=int(cfg["vision_start_token_id"]),
                vision_end_id=int(cfg["vision_end_token_id"]),
                patch_size=int(pre.get("patch_size") or vis.get("patch_size")),
                merge_size=int(pre.get("merge_size") or vis.get("spatial_merge_size")),
                # the processor's own defaults when neither spelling is there
                min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
                max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
                model_type=str(cfg.get("model_type", "")))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{p}: config.json / preprocessor_config.json lack {e} (image token ids, patch_size, "
                             "merge_size); fix: the checkpoint's own files from its release") from None

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(h', w') the image processor resizes an ``height x width`` picture to (module docstring)."""
        f = self.factor
        h, w = f * round(height / f), f * round(width / f)
        if h * w > self.max_pixels:
            b = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, f * math.floor(height / b / f)), max(f, f * math.floor(width / b / f))
        elif h * w < self.min_pixels:
            b = math.sqrt(self.min_pixels / (height * width))
            h, w = f * math.ceil(height * b / f), f * math.ceil(width * b / f)
        return h, w

    def tokens(self, height: int, width: int) -> int:
        """Image tokens of an ``height x width`` picture: (h' * w') / (patch * merge)^2."""
        h, w = self.resized(height, width)
        return (h // self.factor) * (w // self.factor)

    def check_size(self, width: int, height: int) -> None:
        """ImageError for a picture the processor cannot or should not take (module docstring)."""
        if min(width, height) < 1:
            raise ImageError(f"the image is {width}x{height} pixels")
        if max(width, height) / min(width, height) > MAX_ASPECT:
            raise ImageError(f"the image is {width}x{height} pixels, an aspect ratio over {MAX_ASPECT} (the image "
                             "processor refuses it)")
        if width * height > FAR_OVER * self.max_pixels:
            raise ImageError(f"the image is {width}x{height} = {width * height} pixels, over {FAR_OVER} x the "
                             f"processor's max_pixels={self.max_pixels} (it would be shrunk to "
                             f"{self.tokens(height, width)} tokens): is it the right file? fix: downscale it first")


def image_bytes(ref: Any) -> bytes:
    """The encoded bytes of one picture reference (module docstring); ImageError says what is wrong."""
    if isinstance(ref, dict):
        data, path = ref.get("bytes"), ref.get("path")
        if isinstance(data, str):  # JSON has no bytes: {"bytes": "<base64>"}
            try:
                return base64.b64decode(data, validate=True)
            except ValueError:
                raise ImageError("an image's 'bytes' is a string that is not base64 (JSON rows carry bytes as "
                                 "base64)") from None
        if data is not None:
            return image_bytes(data)
        if path:
            return image_bytes(str(path))
        raise ImageError(f"an image entry with neither 'bytes' nor 'path' ({sorted(ref)})")
    if isinstance(ref, bytes | bytearray | memoryview):
        return bytes(ref)
    if isinstance(ref, str):
        if ref.startswith("data:"):  # a data URL: data:image/png;base64,....
            try:
                return base64.b64decode(ref.split(",", 1)[1], validate=True)
            except (IndexError, ValueError):
                raise ImageError("a data: URL whose payload is not base64") from None
        if "://" in ref and not ref.startswith("file://"):
            raise ImageError(f"{ref[:80]!r} is a remote URL; mrl reads images from files: download them first")
        p = Path(ref.removeprefix("file://"))
        if not p.is_file():
            raise ImageError(f"image file {str(p)!r} does not exist" + ("" if p.is_absolute() else
                             f" (relative paths are read from {Path.cwd()})"))
        return p.read_bytes()
    raise ImageError(f"an image entry is a {type(ref).__name__}; expected bytes, {{'bytes': ...}}, a path or a "
                     "file:// URL")


def open_image(ref: Any, *, decode: bool = True):
    """PIL image of one picture reference, RGB. ``decode=False`` reads only the header (size, format)."""
    from PIL import Image, UnidentifiedImageError

    data = image_bytes(ref)
    try:
        img = Image.open(io.BytesIO(data))
        if decode:
            img.load()
            img = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image bytes are not a readable picture ({type(e).__name__}: {str(e)[:100]})") from None
    return img


def image_list(value: Any) -> list[Any]:
    """A row's image column as a list (None or a missing column: no images; one entry: a list of one)."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    if hasattr(value, "tolist") and not isinstance(value, bytes | str):  # a numpy array from pandas
        return list(value.tolist())
    return [value]


def count_placeholders(prompt: str | Sequence[dict]) -> int:
    """``<image>`` occurrences in a string prompt or in the messages' text."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in prompt)


def check_row_images(prompt: Any, refs: list[Any], spec: VisionSpec | None, *, decode: bool = True) -> list[tuple[int, int]]:
    """(width, height) of each picture of one row, checked: the count matches the ``<image>`` placeholders,
    each reads (``decode``: fully, else its header) and its size passes ``spec.check_size``. ImageError names the
    picture (1-based) and the problem."""
    n = count_placeholders(prompt)
    if n != len(refs):
        more = "placeholders than images" if n > len(refs) else "images than placeholders"
        raise ImageError(f"the prompt has {n} {IMAGE_PLACEHOLDER} placeholder(s) but the row has {len(refs)} image(s) "
                         f"(more {more}); every picture needs one {IMAGE_PLACEHOLDER} in the text, in order")
    sizes = []
    for k, ref in enumerate(refs, start=1):
        try:
            img = open_image(ref, decode=decode)
            if spec is not None:
                spec.check_size(*img.size)
        except ImageError as e:
            raise ImageError(f"image {k} of {len(refs)}: {e}") from None
        sizes.append(img.size)
    return sizes


def with_vision_tokens(prompt: str | list[dict], start: str, pad: str, end: str) -> str | list[dict]:
    """The prompt with each ``<image>`` replaced by ``start pad end`` (the checkpoint's token strings)."""
    rep = start + pad + end
    if isinstance(prompt, str):
        return prompt.replace(IMAGE_PLACEHOLDER, rep)
    return [{**m, "content": str(m["content"]).replace(IMAGE_PLACEHOLDER, rep)} for m in prompt]


def expand_image_tokens(ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> list[int]:
    """Engine ids (one ``image_token_id`` per picture) -> trainer ids (``counts[k]`` of them for picture k).
    ValueError when the ids hold another number of image tokens than ``counts`` has pictures."""
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_token_id:
            if k >= len(counts):
                raise ValueError(f"the prompt holds more image tokens than its {len(counts)} image(s)")
            out.extend([image_token_id] * counts[k])
            k += 1
        else:
            out.append(t)
    if k != len(counts):
        raise ValueError(f"the prompt holds {k} image token(s) for {len(counts)} image(s)")
    return out


def png_base64(ref: Any) -> str:
    """One picture as SGLang's ``image_data`` string: base64 of its PNG encoding (any input format)."""
    buf = io.BytesIO()
    open_image(ref).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_vision_prompt(tokenizer: Any, prompt: str | list[dict], sizes: Sequence[tuple[int, int]],
                         spec: VisionSpec, tools: Sequence[dict] | None = None) -> tuple[list[int], list[int], list[int]]:
    """(trainer ids, engine ids, image tokens per picture) of a prompt whose ``<image>`` placeholders stand for
    pictures of ``sizes`` [(width, height)]: rendered like a text prompt (chat template when the tokenizer
    has one) with the checkpoint's vision tokens in place of each placeholder (module docstring)."""
    from mrl.data.tokenize import encode_prompt

    start, pad, end = tokenizer.convert_ids_to_tokens([spec.vision_start_id, spec.image_token_id, spec.vision_end_id])
    engine_ids = encode_prompt(tokenizer, with_vision_tokens(prompt, start, pad, end), tools)
    counts = [spec.tokens(h, w) for w, h in sizes]
    return expand_image_tokens(engine_ids, spec.image_token_id, counts), engine_ids, counts
