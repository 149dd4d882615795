"""Pictures in the RL step (vision-language models; docs/vision.md).

A prompt with pictures travels two ways, and both must describe the same pixels:

* **to the engines** as SGLang takes it: the *engine* ids (one ``<|image_pad|>`` per picture) and
  ``image_data`` (one base64 PNG per picture, in order); the engine runs the checkpoint's image processor
  and expands each image token to the picture's token count itself (SGLang's rule);
* **to the trainer** as the Megatron model reads it: the *trainer* ids (every image token expanded; the data
  layer wrote them, mrl/data/images.py) and, per sample, ``multi_modal = {"pixel_values": [patches,
  C*T*P*P], "image_grid_thw": [pictures, 3]}``, the image processor's output for the sample's pictures
  (TrainBatch.multi_modal; ``{}`` for a sample without pictures).

The data layer counts a picture's tokens with the processor's resize rule; :meth:`Pictures.model_inputs`
runs the processor itself and refuses, naming the row, a picture whose grid gives another count (the two
sides would then see different sequences: a silent misalignment of every later token).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mrl.data.images import VisionSpec, open_image, png_base64


def vision_spec(model_path: str | Path) -> VisionSpec | None:
    """The checkpoint's :class:`VisionSpec` when the actor runs its vision tower (pictures in the prompt files
    train: :func:`mrl.config.checkpoint_files.trains_pictures`); None for a text model and for a release whose
    tower mrl carries without running it (its rows with pictures are refused by the data layer)."""
    import json

    from mrl.config.checkpoint_files import trains_pictures

    file = Path(model_path) / "config.json"
    if not file.is_file():  # a text model named by a hub id (check_inputs vouches for the files a run needs)
        return None
    return VisionSpec.from_checkpoint(model_path) if trains_pictures(json.loads(file.read_text())) else None


def request_inputs(prompts: Sequence[Any]) -> tuple[list[list[int]], list[list[str]] | None]:
    """(ids, image_data) of a rollout request for ``prompts`` (mrl.data.dataset.Prompt): the engine ids and
    the pictures as base64 PNG for prompts with pictures, the trainer ids otherwise; ``image_data`` is None
    when no prompt has a picture (a text request, unchanged)."""
    if not any(p.images for p in prompts):
        return [list(p.prompt_ids) for p in prompts], None
    ids = [list(p.engine_prompt_ids) if p.images else list(p.prompt_ids) for p in prompts]
    return ids, [[png_base64(ref) for ref in p.images] for p in prompts]


class Pictures:
    """The checkpoint's image processor (transformers' PIL backend, as the engine runs it) and its merge
    size: a picture of grid (t, h, w) patches becomes ``t*h*w / merge^2`` image tokens."""

    def __init__(self, model_path: str | Path, spec: VisionSpec) -> None:
        from transformers import AutoImageProcessor

        self.merge = spec.merge_size
        self.processor = AutoImageProcessor.from_pretrained(model_path, backend="pil")

    def model_inputs(self, prompts: Sequence[Any]) -> list[dict[str, torch.Tensor]]:
        """Per prompt, the trainer's ``multi_modal`` entry (module docstring); ValueError names the row whose
        picture the processor tokenises differently from the data layer."""
        out: list[dict[str, torch.Tensor]] = []
        for p in prompts:
            if not p.images:
                out.append({})
                continue
            got = self.processor(images=[open_image(ref) for ref in p.images], return_tensors="pt")
            grid = got["image_grid_thw"].long()
            counts = (grid.prod(-1) // self.merge ** 2).tolist()
            if counts != list(p.image_tokens):
                raise ValueError(f"{p.source}: the image processor makes {counts} image tokens of the row's pictures, "
                                 f"the prompt holds {list(p.image_tokens)} (preprocessor_config.json and the data "
                                 "layer's resize rule disagree); fix: report it with the row's pictures")
            out.append({"pixel_values": got["pixel_values"].float(), "image_grid_thw": grid})
        return out
