"""Data section: prompt datasets and the global batch size (in PROMPTS).

``train_batch_size`` prompts per step become ``train_batch_size * rollout.n`` samples.
"""
from __future__ import annotations

from pydantic import Field, field_validator

from mrl.config.base import Section
from mrl.config.extensions import PluginSpec


class SamplerConfig(Section):
    """Which prompts each step draws (verl ``data.sampler``)."""

    class_path: PluginSpec = Field(
        "resumable", description="Sampler registry name (resumable = seeded per-epoch shuffle, checkpointed) or a "
        "plugin class 'pkg.module:Cls' / 'path/to/file.py:Cls' (docs/plugins.md).")


class DataConfig(Section):
    """Prompt datasets (parquet or jsonl) and tokenization limits (verl ``data``)."""

    train_files: list[str] = Field(default_factory=list, description="Training prompt files (.parquet or .jsonl); required.")
    val_files: list[str] = Field(default_factory=list, description="Validation prompt files (.parquet or .jsonl); empty disables validation.")
    prompt_key: str = Field("prompt", description="Column holding the prompt (string or chat messages).")
    ground_truth_key: str = Field("reward_model.ground_truth", description="Column (dotted for nested) holding the reference answer.")
    image_key: str = Field("images", description="Column holding each row's pictures (vision-language models; verl's "
                           "name): a list of bytes, {'bytes': ...}, paths or file:// URLs, one per <image> in the "
                           "prompt, in order (docs/vision.md).")
    filter_bad_images: bool = Field(False, description="Drop rows whose pictures cannot be used (unreadable, missing "
                                    "file, <image> count off, far over max_pixels) instead of failing; the count is "
                                    "logged (docs/vision.md).")
    max_prompt_length: int = Field(512, ge=1, description="TOKENS per prompt at most (left-padded; image tokens "
                                   "included).")
    filter_overlong_prompts: bool = Field(True, description="Drop prompts longer than max_prompt_length instead of failing.")
    shuffle: bool = Field(True, description="Shuffle training prompts every epoch.")
    seed: int = Field(1, ge=0, lt=2**63, description="Seed of the prompt sampler (state is checkpointed).")
    sampler: SamplerConfig = Field(default_factory=SamplerConfig, description="Prompt sampler.")
    train_batch_size: int = Field(256, ge=1, description="PROMPTS per training step (global, all DP ranks).")
    val_batch_size: int | None = Field(None, ge=1, description="PROMPTS per validation batch; null = whole validation set.")
    gen_batch_size: int | None = Field(
        None, ge=1, description="PROMPTS per generation round with algorithm.filter_groups (DAPO over-samples: "
        "> train_batch_size); null = train_batch_size.")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_file_is_a_list(cls, v: object) -> object:
        # `data.train_files=a.jsonl` on the command line is a single string; accept it as a 1-list.
        return [v] if isinstance(v, str) else v
