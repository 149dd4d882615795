"""JSON shapes of the SGLang native HTTP protocol subset that mrl speaks to every engine.

Field names and defaults follow SGLang (``python/sglang/srt/managers/io_struct.py`` and
``sampling/sampling_params.py`` in sgl-project/sglang); mrl-only additions are marked "mrl".
The embedded engine validates requests with these models; the router/client builds them.

Responses of ``POST /generate`` (one dict per prompt; a list for batch requests)::

    {"text": str, "output_ids": [int], "meta_info": {
        "id": rid, "finish_reason": {"type": "stop", "matched": int|str} | {"type": "length",
        "length": int} | {"type": "abort", "message": str}, "prompt_tokens": int,
        "completion_tokens": int, "cached_tokens": 0, "weight_version": str, "e2e_latency": float,
        "output_token_logprobs": [[logprob, token_id, None], ...]   # only if return_logprob}}
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# SGLang sampling parameters this engine does not implement; accepted only at their default
# value so that a request relying on them fails loudly instead of being sampled differently.
UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
}
# Accepted and ignored: they change nothing observable in this engine.
IGNORED_SAMPLING_KEYS = {"spaces_between_special_tokens", "stream_interval", "custom_params"}


class SamplingParams(BaseModel):
    """SGLang ``sampling_params``. temperature 0 means greedy. top_k -1 (or 0) means the full
    vocabulary. ``sampling_seed`` (SGLang's name) makes one request's draws reproducible
    regardless of which other requests share its batch."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @model_validator(mode="after")
    def _check_extras(self) -> SamplingParams:
        for key, value in (self.model_extra or {}).items():
            if key in IGNORED_SAMPLING_KEYS:
                continue
            if key in UNSUPPORTED_SAMPLING_DEFAULTS:
                if value != UNSUPPORTED_SAMPLING_DEFAULTS[key]:
                    raise ValueError(
                        f"sampling_params.{key}={value!r} is not supported by the embedded engine; "
                        f"drop it or use rollout.engine: sglang"
                    )
                continue
            valid = sorted(set(type(self).model_fields) | set(UNSUPPORTED_SAMPLING_DEFAULTS))
            raise ValueError(f"unknown sampling_params key {key!r}; valid keys: {valid}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateReqInput(BaseModel):
    """SGLang ``GenerateReqInput`` subset: exactly one of ``text`` / ``input_ids``; a list of
    prompts makes a batch request whose response is a list. ``sampling_params`` may be one dict
    for all prompts or a list with one per prompt; ``rid`` likewise (a str is used as prefix)."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    rid: str | list[str] | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("/generate needs exactly one of 'text' or 'input_ids'")
        if self.stream:
            raise ValueError("stream=true is not supported by the embedded engine; send stream=false")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text if self.text is not None else self.input_ids)  # type: ignore[arg-type]

    def item(self, i: int) -> tuple[str | None, list[int] | None, SamplingParams, bool, str | None]:
        """(text, input_ids, sampling params, return_logprob, rid) of prompt ``i``."""
        n = self.batch_size
        text = (self.text[i] if self.is_batch else self.text) if self.text is not None else None  # type: ignore[index]
        ids = (self.input_ids[i] if self.is_batch else self.input_ids) if self.input_ids is not None else None  # type: ignore[index]
        sp = self.sampling_params or {}
        if isinstance(sp, list):
            if len(sp) != n:
                raise ValueError(f"sampling_params has {len(sp)} entries for {n} prompts; send one dict or one per prompt")
            sp = sp[i]
        lp = self.return_logprob[i] if isinstance(self.return_logprob, list) else self.return_logprob
        rid = self.rid
        if isinstance(rid, list):
            if len(rid) != n:
                raise ValueError(f"rid has {len(rid)} entries for {n} prompts")
            rid = rid[i]
        elif rid is not None and self.is_batch:
            rid = f"{rid}_{i}"
        return text, ids, SamplingParams(**sp), bool(lp), rid


class AbortReqInput(BaseModel):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(BaseModel):
    """SGLang's modes and default: "abort" ends in-flight requests (finish_reason abort);
    "retract" sends running requests back to the queue (their KV is rebuilt after
    /continue_generation, no token lost); "in_place" keeps them with their cache (then
    /flush_cache is refused until they finish). mrl's weight sync pauses with "retract"."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class WeightUpdateSessionReqInput(BaseModel):
    """/begin_weight_update and /end_weight_update (SGLang >= 0.5.22): distributed and tensor
    weight updates are accepted only between the two. ``selector`` is SGLang's (target/draft/all);
    the embedded engine has only a target model."""

    selector: Literal["target", "draft", "all"] = "all"


class UpdateWeightFromDiskReqInput(BaseModel):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class InitWeightsUpdateGroupReqInput(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(BaseModel):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReqInput(BaseModel):
    """names/dtypes/shapes of the tensors rank 0 broadcasts next. load_format None: one
    broadcast per tensor, in order; "flattened_bucket": one broadcast of a uint8 vector holding
    every tensor's bytes concatenated in order (see docs/rollout.md)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedReqInput:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names/dtypes/shapes lengths differ ({len(self.names)}/{len(self.dtypes)}/{len(self.shapes)})"
            )
        return self


class ShmTensor(BaseModel):
    """mrl: one tensor inside a POSIX shared-memory segment ``/dev/shm/<shm_name>`` written by a
    process on the same host: ``numel(shape) * itemsize(dtype)`` bytes at byte ``offset``, C order."""

    name: str
    shm_name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,200}$")
    dtype: str
    shape: list[int]
    offset: int = Field(0, ge=0)


class UpdateWeightsFromTensorReqInput(BaseModel):
    """SGLang's request carries pickled tensors (``serialized_named_tensors``); the embedded
    engine refuses them (no unpickling of network input) and reads ``shm_tensors`` (mrl) instead."""

    serialized_named_tensors: list[Any] | None = None
    shm_tensors: list[ShmTensor] = Field(default_factory=list)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class GetWeightsByNameReqInput(BaseModel):
    name: str
    truncate_size: int = 100


class WeightsChecksumReqInput(BaseModel):
    """mrl: ``names`` None means every parameter (HF names, tied ones under each name)."""

    names: list[str] | None = None


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class MemoryOccupationReqInput(BaseModel):
    """SGLang's tags: None/[] = everything; "weights", "kv_cache" (and "cuda_graph", which a CPU
    engine does not have: accepted, nothing to release)."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None

    def released(self, tag: str) -> bool:
        return not self.tags or tag in self.tags


class UpdateWeightsReqOutput(BaseModel):
    success: bool
    message: str
    weight_version: str | None = None
    num_paused_requests: int = 0
