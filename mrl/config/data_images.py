"""What ``mrl plan`` / ``mrl train`` know of the pictures in the prompt files before anything starts
(vision-language prompts: mrl/data/images.py, docs/vision.md).

Scanned when ``model.path`` is a vision-language checkpoint (``vision_config`` in its config.json) or a
prompt file has the ``data.image_key`` column: every row's pictures are counted against its ``<image>``
placeholders, each picture's header is read (size, format; ``mrl train`` decodes every picture again when it
loads the data) and checked against the image processor's ``max_pixels`` (mrl.data.images.VisionSpec). A bad
picture is an error naming ``file:row`` (or, with ``data.filter_bad_images``, a note with the count of rows
that will be dropped). The summary gives the pictures per split, the most in one row, and the largest
picture's image tokens (its share of ``data.max_prompt_length``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mrl.config.root import MRLConfig


@dataclass
class ImageScan:
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # the plan's summary lines


def _has_column(path: Path, key: str) -> bool:
    """The file's first row (a .parquet file: its schema) has ``key``."""
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            return key in pq.ParquetFile(path).schema_arrow.names
        with path.open("rb") as f:
            for raw in f:
                if raw.strip():
                    row = json.loads(raw)
                    return isinstance(row, dict) and key in row
    except Exception:  # noqa: BLE001 - an unreadable file is check_data_files' error, not this scan's
        return False
    return False


def scan_images(cfg: MRLConfig) -> ImageScan:
    """Check the pictures of every configured prompt file that exists (module docstring)."""
    from mrl.data.images import ImageError, VisionSpec, check_row_images, image_list
    from mrl.data.rows import DataError, get_dotted, read_rows

    out = ImageScan()
    total = 0  # pictures over every split
    d = cfg.data
    spec, model_dir = None, Path(cfg.model.path or "")
    if not (model_dir / "config.json").is_file():  # a hub id or a download to come: nothing to check against
        files = [Path(f) for f in (*d.train_files, *d.val_files) if Path(f).is_file()]
        if any(_has_column(p, d.image_key) for p in files):
            out.notes.append(f"not checked: model.path={cfg.model.path!r} has no config.json here, so the image "
                             "processor's settings are unknown (mrl train checks every picture when it loads the data)")
        return out
    files = [Path(f) for f in (*d.train_files, *d.val_files) if Path(f).is_file()]
    if not any(_has_column(p, d.image_key) for p in files):
        return out  # text-only prompts (a vision-language checkpoint trained on text) need no processor
    try:
        spec = VisionSpec.from_checkpoint(model_dir)
    except (ValueError, OSError) as e:
        out.errors.append(f"model.path: {e}")
        return out
    for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        paths = [Path(f) for f in files if Path(f).is_file() and f.endswith((".jsonl", ".parquet"))]
        if not paths or (spec is None and not any(_has_column(p, d.image_key) for p in paths)):
            continue
        pictures, rows_with, most, dropped = 0, 0, 0, 0
        largest: tuple[int, str, int, int] | None = None  # (tokens, file:row, width, height)
        for p in paths:
            try:
                rows = read_rows(p)
            except DataError:
                continue  # check_data_files reports it
            for i, row in enumerate(rows, start=1):
                refs = image_list(row.get(d.image_key))
                if not refs and spec is None:
                    continue
                where = f"{p}:{i}"
                if spec is None:
                    out.errors.append(f"{where}: column {d.image_key!r} (data.image_key) holds {len(refs)} image(s), but "
                                      f"model.path={cfg.model.path!r} is not a vision-language checkpoint; fix: a "
                                      "vision-language model.path, or drop the images")
                    break
                try:
                    sizes = check_row_images(get_dotted(row, d.prompt_key, ""), refs, spec, decode=False)
                except ImageError as e:
                    if d.filter_bad_images:
                        dropped += 1
                        continue
                    out.errors.append(f"{where}: column {d.image_key!r} (data.image_key): {e}; fix the row, or set "
                                      "data.filter_bad_images=true to drop such rows")
                    if len(out.errors) >= 10:
                        out.errors.append("(stopped after 10 bad pictures)")
                        return out
                    continue
                pictures += len(sizes)
                rows_with += bool(sizes)
                most = max(most, len(sizes))
                for w, h in sizes:
                    t = spec.tokens(h, w)
                    if largest is None or t > largest[0]:
                        largest = (t, where, w, h)
        total += pictures
        if dropped:
            out.notes.append(f"{key}: {dropped} row(s) with unusable pictures will be dropped (data.filter_bad_images=true)")
        if spec is not None:
            big = (f"; largest picture {largest[2]}x{largest[3]} = {largest[0]} image tokens ({largest[1]}) of "
                   f"data.max_prompt_length={d.max_prompt_length}" if largest else "")
            out.lines.append(f"{key}: {pictures} pictures in {rows_with} rows (at most {most} per row){big}")
    if total and spec is not None:
        out.errors.extend(_refusals(cfg, json.loads((model_dir / "config.json").read_text())))
    return out


def _refusals(cfg: MRLConfig, model: dict) -> list[str]:
    """What a run with pictures cannot do yet, one line each naming the key and the fix."""
    from mrl.config.checkpoint_files import trains_pictures, untrainable_vision_language

    if untrainable_vision_language(model):  # no family at all: checkpoint_files' VISION_REFUSAL is the one line
        return []
    if not trains_pictures(model):  # Qwen3.5-MoE's releases: the tower is carried, not run (docs/vision.md)
        archs = ", ".join(map(str, model.get("architectures") or [model.get("model_type")]))
        return [(f"data.image_key={cfg.data.image_key!r}: the prompt files hold pictures, but mrl trains "
                 f"model.path={cfg.model.path!r} ({archs}) on text only (its vision tower is carried through "
                 "checkpoints, not run); fix: text prompts, or a vision-language model mrl runs (docs/vision.md)")]
    out = []
    for on, key, why in (
            (cfg.agent.enable, "agent.enable", "the agent loop's turns carry no pictures yet"),
            (cfg.rollout.partial_rollout, "rollout.partial_rollout", "a continued request does not re-send its pictures yet"),
            (cfg.actor.moe.engine_routed_experts, "actor.moe.routing_replay",
             "the engine's expert ids cover its ids, one image token per picture, not the trainer's expanded ones"),
            (cfg.reward_model.enable, "reward_model.enable", "the reward model reads text; its prompt would hold image tokens"),
            (cfg.reward.judge.enable, "reward.judge.enable", "the judge reads text; its prompt would hold image tokens")):
        if on:
            out.append(f"{key}: not supported with pictures in the prompts ({why}); fix: turn it off, or text prompts")
    return out
