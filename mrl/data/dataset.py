"""Prompt datasets from .jsonl / .parquet files (verl's RLHFDataset, reduced to what the loop needs).

Each row yields a ``Prompt``: the rendered, tokenized prompt (at most ``max_prompt_length`` tokens)
and its ground truth read from ``ground_truth_key`` (dotted for nested, e.g.
``reward_model.ground_truth``). A batch of prompts collates to left-padded tensors [B, P] with
P = max_prompt_length (see ``mrl.data.tokenize``). ``repeat_interleave`` expands B prompts to
B*n samples with one uid per prompt, interleaved as verl does: p0 p0 .. p1 p1 ..
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from mrl.data.images import (
    ImageError,
    VisionSpec,
    check_row_images,
    encode_vision_prompt,
    image_list,
)

# torch-free, so that mrl plan reads prompt files without the model stack (re-exported here)
from mrl.data.rows import DataError, get_dotted, read_rows
from mrl.data.tokenize import (
    encode_prompt,
    left_pad,
    pad_token_id_of,
    position_ids_from_mask,
)

log = logging.getLogger("mrl.data")
T = TypeVar("T")


@dataclass
class Prompt:
    """One prompt row: token ids (unpadded), the raw prompt, and reward inputs."""

    prompt_ids: list[int]
    raw_prompt: str | list[dict]
    ground_truth: Any
    data_source: str | None = None
    extra_info: dict | None = None
    source: str = ""  # "file:row" for error messages and debugging
    #: vision-language rows (mrl/data/images.py): the row's pictures as given (bytes / {"bytes"} / path), the
    #: ids the engine gets (one image token per picture: SGLang expands them from image_data) and the image
    #: tokens of each picture; ``prompt_ids`` then holds every image token (what the trainer and the limits count)
    images: list[Any] = field(default_factory=list)
    engine_prompt_ids: list[int] | None = None
    image_tokens: list[int] = field(default_factory=list)


@dataclass
class PromptBatch:
    """B prompts, left-padded to P = max_prompt_length."""

    input_ids: torch.Tensor  # [B, P] long
    attention_mask: torch.Tensor  # [B, P] long
    position_ids: torch.Tensor  # [B, P] long
    prompts: list[Prompt] = field(default_factory=list)


class PromptDataset:
    """Prompts of ``files`` rendered with ``tokenizer`` (chat template for message lists when present).

    Prompts over ``max_prompt_length`` tokens are dropped when ``filter_overlong_prompts`` (the count
    is logged and kept in ``num_filtered``), else they raise an error naming the file and row.
    ``tools`` (agent rollouts): OpenAI function schemas rendered into every prompt by the chat template's
    ``tools=`` argument (verl's multi-turn rows: ``prompt`` as chat messages, ``extra_info.tools_kwargs``).
    ``vision`` (a vision-language checkpoint's :class:`~mrl.data.images.VisionSpec`): rows carry pictures in
    ``image_key``, checked as they load (mrl/data/images.py); a bad one raises naming the row, or with
    ``filter_bad_images`` the row is dropped and counted in ``num_bad_images``. Image tokens count in
    ``max_prompt_length``. Without ``vision`` a row with pictures is an error (a text model cannot see them).
    """

    def __init__(self, files: Sequence[str | Path], tokenizer: Any, *, prompt_key: str = "prompt",
                 ground_truth_key: str = "reward_model.ground_truth", max_prompt_length: int = 512,
                 filter_overlong_prompts: bool = True, config_key: str = "data.train_files",
                 scalar_ground_truth: bool = False, tools: Sequence[dict] | None = None,
                 image_key: str = "images", vision: VisionSpec | None = None, filter_bad_images: bool = False) -> None:
        if not files:
            raise DataError(f"{config_key} is empty; fix: {config_key}=[path/to/prompts.jsonl]")
        self.tokenizer, self.max_prompt_length = tokenizer, max_prompt_length
        self.filter_bad_images = filter_bad_images
        self.pad_token_id = pad_token_id_of(tokenizer)
        self.prompts: list[Prompt] = []
        self.num_filtered = 0
        self.num_bad_images = 0
        for f in files:
            for i, row in enumerate(read_rows(f)):
                where = f"{f}:{i + 1}"
                prompt = self._column(row, prompt_key, where, "data.prompt_key")
                _check_prompt(prompt, f"{where}: column {prompt_key!r} (data.prompt_key)")
                gt = self._column(row, ground_truth_key, where, "data.ground_truth_key")
                _check_ground_truth(gt, f"{where}: column {ground_truth_key!r} (data.ground_truth_key)", scalar_ground_truth)
                if tools is not None:
                    _check_agent_row(row, prompt, tools, where, prompt_key)
                refs = image_list(row.get(image_key))
                if refs or vision is not None:
                    vis = self._vision_row(prompt, refs, vision, tools, where, image_key, prompt_key)
                    if vis is None:  # filter_bad_images dropped it
                        continue
                    ids = vis[0]
                else:
                    try:
                        ids = encode_prompt(tokenizer, prompt, tools)
                    except ValueError as e:
                        raise DataError(f"{where}: column {prompt_key!r}: {e}") from None
                if len(ids) > max_prompt_length:
                    if filter_overlong_prompts:
                        self.num_filtered += 1
                        continue
                    raise DataError(
                        f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}; fix: raise "
                        "data.max_prompt_length, shorten the prompt, or set data.filter_overlong_prompts=true"
                    )
                extra = row.get("extra_info")
                p = Prompt(ids, prompt, gt, row.get("data_source"), extra if isinstance(extra, dict) else None, where)
                if vision is not None:
                    p.images, p.engine_prompt_ids, p.image_tokens = refs, vis[1], vis[2]
                self.prompts.append(p)
        if self.num_bad_images:
            log.warning("dropped %d of %d prompts with unusable images (data.filter_bad_images=true) (%s)",
                        self.num_bad_images, self.num_bad_images + self.num_filtered + len(self.prompts),
                        ", ".join(map(str, files)))
        if self.num_filtered:
            log.warning("dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (%s)",
                        self.num_filtered, self.num_filtered + len(self.prompts), max_prompt_length, ", ".join(map(str, files)))
        if not self.prompts:
            raise DataError(f"no prompts left in {', '.join(map(str, files))} (filtered {self.num_filtered} overlong); "
                             "fix: raise data.max_prompt_length or check the files")

    def _vision_row(self, prompt: Any, refs: list[Any], vision: VisionSpec | None, tools: Sequence[dict] | None,
                    where: str, image_key: str, prompt_key: str) -> tuple[list[int], list[int], list[int]] | None:
        """(trainer ids, engine ids, tokens per picture) of a row with pictures; None when ``filter_bad_images``
        drops it. The pictures are decoded here, before anything starts (a bad one fails no step mid-run)."""
        if vision is None:
            raise DataError(f"{where}: column {image_key!r} (data.image_key) holds {len(refs)} image(s), but model.path "
                            "is a text-only model; fix: a vision-language checkpoint, or drop the images")
        try:
            sizes = check_row_images(prompt, refs, vision)
        except ImageError as e:
            if self.filter_bad_images:
                self.num_bad_images += 1
                return None
            raise DataError(f"{where}: column {image_key!r} (data.image_key): {e}; fix the row, or set "
                            "data.filter_bad_images=true to drop such rows (counted in the log)") from None
        try:
            return encode_vision_prompt(self.tokenizer, prompt, sizes, vision, tools)
        except ValueError as e:  # e.g. the text spells the image token itself
            raise DataError(f"{where}: column {prompt_key!r}: {e}") from None

    @staticmethod
    def _column(row: dict, key: str, where: str, config_key: str) -> Any:
        try:
            return get_dotted(row, key)
        except KeyError:
            raise DataError(
                f"{where}: no column {key!r} ({config_key}); columns: {', '.join(sorted(row))}; "
                f"fix: {config_key}=<one of them> (dotted for nested, e.g. reward_model.ground_truth)"
            ) from None

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any, split: str = "train", *,
                    scalar_ground_truth: bool = False, tools: Sequence[dict] | None = None,
                    vision: VisionSpec | None = None) -> PromptDataset:
        """From ``mrl.config.data.DataConfig``; ``split`` train | val picks train_files / val_files.
        ``scalar_ground_truth``: every ground truth must be a string or number (the built-in scorers).
        ``vision``: ``VisionSpec.from_checkpoint(model.path)`` for a vision-language model."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        return cls(cfg.train_files if split == "train" else cfg.val_files, tokenizer, prompt_key=cfg.prompt_key,
                   ground_truth_key=cfg.ground_truth_key, max_prompt_length=cfg.max_prompt_length,
                   filter_overlong_prompts=cfg.filter_overlong_prompts, config_key=f"data.{split}_files",
                   scalar_ground_truth=scalar_ground_truth, tools=tools, image_key=cfg.image_key, vision=vision,
                   filter_bad_images=cfg.filter_bad_images)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]

    def collate(self, indices: Sequence[int]) -> PromptBatch:
        """Prompts ``indices`` left-padded to [B, max_prompt_length]."""
        chosen = [self.prompts[i] for i in indices]
        ids, mask = left_pad([p.prompt_ids for p in chosen], self.pad_token_id, self.max_prompt_length)
        return PromptBatch(ids, mask, position_ids_from_mask(mask), chosen)


def _check_prompt(prompt: Any, where: str) -> None:
    """A prompt is a non-empty string or a list of chat messages ``{"role": str, "content": str}`` whose user
    turns are not empty; every text is encodable (no lone UTF-16 surrogate, which no tokenizer takes)."""
    if isinstance(prompt, str):
        if prompt.strip():
            _check_text(prompt, where)
            return
        raise DataError(f"{where}: the prompt is empty; fix: remove the row or give it a prompt")
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt):
        blank = [k for k, m in enumerate(prompt) if not m["content"].strip()]
        if len(blank) == len(prompt):
            raise DataError(f"{where}: the prompt is empty (every chat message's content is blank); fix: remove the "
                            "row or give it a prompt")
        user = [k for k in blank if prompt[k]["role"] == "user"]
        if user:
            raise DataError(f"{where}: chat message {user[0]} (role user) has empty content; fix: give it the "
                            "question, or remove the message or the row")
        for k, m in enumerate(prompt):
            _check_text(m["content"], f"{where}: chat message {k}")
        return
    raise DataError(f"{where}: the prompt is a {type(prompt).__name__} ({_short(prompt)}); fix: a string or a list of "
                    'chat messages [{"role": "user", "content": "..."}]')


def _check_text(text: str, where: str) -> None:
    """A lone surrogate (a JSON ``"\\udcff"`` escape without its pair) makes the tokenizer raise a TypeError that
    names no row: refuse it here with the position."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: the prompt holds a lone UTF-16 surrogate {text[e.start]!r} at character {e.start} "
                        "(a JSON \\uXXXX escape without its pair: not a character, no tokenizer encodes it); fix: "
                        "repair the text (re-export the file from its source as UTF-8) or remove the row") from None


def _check_agent_row(row: dict, prompt: Any, tools: Sequence[dict], where: str, prompt_key: str) -> None:
    """Agent rows (verl's multi-turn schema): chat-message prompts; ``extra_info.tools_kwargs`` maps
    configured tool names to dicts of keyword arguments."""
    if isinstance(prompt, str):
        raise DataError(f"{where}: column {prompt_key!r} is a string, but agent.enable renders prompts with the chat "
                        'template and the tools; fix: chat messages [{"role": "user", "content": "..."}]')
    extra = row.get("extra_info")
    kw = extra.get("tools_kwargs") if isinstance(extra, dict) else None
    if kw is None:
        return
    names = {t["function"]["name"] for t in tools}
    if not isinstance(kw, dict) or not all(isinstance(v, dict) for v in kw.values()):
        raise DataError(f"{where}: extra_info.tools_kwargs must map tool names to dicts of keyword arguments, got {_short(kw)}")
    unknown = sorted(set(kw) - names)
    if unknown:
        raise DataError(f"{where}: extra_info.tools_kwargs names tools {unknown} that agent.tools does not configure "
                        f"({', '.join(sorted(names))}); fix: add them to agent.tools or drop them from the row")


def _check_ground_truth(gt: Any, where: str, scalar: bool) -> None:
    """No null ground truth; with the built-in scorers (``scalar``) a string or a number (not a bool)."""
    if gt is None:
        raise DataError(f"{where}: the ground truth is null; fix: give every row a reference answer or drop the row")
    if scalar and (isinstance(gt, bool) or not isinstance(gt, str | int | float)):
        raise DataError(f"{where}: the ground truth is a {type(gt).__name__} ({_short(gt)}); the built-in scorers compare "
                        "it as text: fix: a string or number (or score with your own reward.function)")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def check_batch_fits(num_prompts: int, batch_size: int, files: Sequence[str | Path], num_filtered: int) -> None:
    """Refuse a step batch larger than the (filtered) dataset before anything starts."""
    if batch_size > num_prompts:
        filt = f" after dropping {num_filtered} overlong prompts" if num_filtered else ""
        raise DataError(f"data.train_batch_size={batch_size} prompts exceeds the {num_prompts} prompts of "
                        f"{', '.join(map(str, files))}{filt}; fix: lower data.train_batch_size (or data.gen_batch_size) "
                        "or add prompts")


def repeat_interleave(items: Sequence[T], n: int, uids: Sequence[str] | None = None) -> tuple[list[T], list[str]]:
    """B items → (B*n items, B*n uids), item i repeated n times in a row with one uid per item.

    verl: ``batch.non_tensor_batch['uid'] = uuid4 per prompt`` then
    ``batch.repeat(n, interleave=True)``: [p0, p0, p1, p1] for n=2. Samples sharing a uid form the
    GRPO group. ``uids`` defaults to fresh uuid4 hex strings.
    """
    if n < 1:
        raise ValueError(f"rollout.n must be >= 1, got {n}")
    if uids is None:
        uids = [uuid.uuid4().hex for _ in items]
    if len(uids) != len(items):
        raise ValueError(f"{len(items)} items but {len(uids)} uids")
    return [x for x in items for _ in range(n)], [u for u in uids for _ in range(n)]
