"""JSON shapes of the SGLang native HTTP protocol subset that mrl speaks to every engine.

Field names and defaults follow SGLang (``python/sglang/srt/managers/io_struct.py`` and
``sampling/sampling_params.py`` in sgl-project/sglang); mrl-only additions are marked "mrl".
The embedded engine validates requests with these models; the router/client builds them.

Responses of ``POST /generate`` (one dict per prompt; a list for batch requests)::

    {"text": str, "output_ids": [int], "meta_info": {
        "id": rid, "finish_reason": {"type": "stop", "matched": int|str} | {"type": "length",
        "length": int} | {"type": "abort", "message": str}, "prompt_tokens": int,
        "completion_tokens": int, "cached_tokens": 0, "weight_version": str, "e2e_latency": float,
        "output_token_logprobs": [[logprob, token_id, None], ...]   # only if return_logprob
        ...}}   # prompt / top log-probs and streaming: see mrl/rollout/engine/serving.py
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# SGLang sampling parameters this engine does not implement; accepted only at their default
# value so that a request relying on them fails loudly instead of being sampled differently.
UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
}
GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: smaller temperatures sample greedily
MAX_N = 128  # samples per prompt in one request
MAX_STOP_REGEX_COUNT, MAX_STOP_REGEX_LEN = 32, 256  # SGLang's bounds: patterns run on the scheduler thread
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs; the same bound for top_logprobs_num
# Accepted and ignored: they change nothing observable in this engine.
IGNORED_SAMPLING_KEYS = {"spaces_between_special_tokens", "stream_interval", "custom_params"}


class SamplingParams(BaseModel):
    """SGLang ``sampling_params``. temperature 0 means greedy; like SGLang, any temperature
    below ``GREEDY_BELOW`` (1e-6) is greedy too (dividing logits by 1e-40 overflows). top_k -1
    (or 0) means the full vocabulary. ``min_p`` drops tokens whose probability is below
    ``min_p`` times the most likely one's. ``n`` samples per prompt (the response is a list).
    ``stop_regex`` ends a sequence when a pattern matches the decoded tail of its output.
    ``sampling_seed`` (SGLang's name) makes one request's draws reproducible regardless of which
    other requests share its batch."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
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
        if len(self.stop_regex_list) > MAX_STOP_REGEX_COUNT:
            raise ValueError(f"sampling_params.stop_regex: at most {MAX_STOP_REGEX_COUNT} patterns, "
                             f"got {len(self.stop_regex_list)}")
        for pattern in self.stop_regex_list:
            if len(pattern.encode()) > MAX_STOP_REGEX_LEN:
                raise ValueError(f"sampling_params.stop_regex: a pattern is {len(pattern.encode())} bytes, "
                                 f"over the limit of {MAX_STOP_REGEX_LEN}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"sampling_params.stop_regex {pattern!r} is not a valid regular expression: {e}") from e
        return self

    @property
    def stop_regex_list(self) -> list[str]:
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# GenerateReqInput fields of SGLang this engine does not implement: refused unless at their
# default, so that a request relying on one fails loudly (other unknown keys are ignored, as SGLang does).
UNSUPPORTED_GENERATE_DEFAULTS: dict[str, Any] = {
    "video_data": None, "audio_data": None, "input_embeds": None, "lora_path": None,
    "token_ids_logprob": None, "return_hidden_states": False, "custom_logit_processor": None,
    "session_params": None,
}


class GenerateReqInput(BaseModel):
    """SGLang ``GenerateReqInput`` subset: exactly one of ``text`` / ``input_ids``; a list of
    prompts makes a batch request whose response is a list. ``sampling_params`` may be one dict
    for all prompts or a list with one per prompt; ``rid`` likewise (a str is used as prefix).

    Log-prob options (SGLang semantics, per prompt or one for all): ``logprob_start_len`` -1
    returns output log-probs only, k >= 0 also the prompt's from position k
    (``input_token_logprobs``; its first entry's log-prob is None, as SGLang's);
    ``top_logprobs_num`` adds the k most likely tokens per position; ``return_text_in_logprobs``
    puts each token's text in the third slot of every ``[logprob, token_id, text]``.
    ``stream`` answers with Server-Sent Events (``data: {json}`` with cumulative text, then
    ``data: [DONE]``).

    ``return_routed_experts`` (SGLang's; the server must run with ``--enable-return-routed-experts``):
    each finished sample's ``meta_info["routed_experts"]`` is base64 of the int32 C-order bytes of
    ``[seqlen - 1 - routed_experts_start_len, num_hidden_layers, num_experts_per_tok]``, the top-k expert ids
    of every token position in ``[routed_experts_start_len, seqlen - 1)`` of prompt + output (seqlen =
    prompt + output tokens; the last output token is never fed to the model). One value for all prompts,
    as in SGLang; ``routed_experts_start_len`` must lie in ``[0, prompt tokens]``."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    image_data: Any = None

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("/generate needs exactly one of 'text' or 'input_ids'")
        for key, value in (self.model_extra or {}).items():
            if key in UNSUPPORTED_GENERATE_DEFAULTS and value not in (UNSUPPORTED_GENERATE_DEFAULTS[key], [], {}):
                raise ValueError(f"{key} is not supported by the embedded engine; drop it or use rollout.engine: sglang")
        for name in ("logprob_start_len", "top_logprobs_num"):
            value = getattr(self, name)
            low, high = (-1, None) if name == "logprob_start_len" else (0, MAX_TOP_LOGPROBS)
            for v in value if isinstance(value, list) else [value]:
                if v < low or (high is not None and v > high):
                    raise ValueError(f"{name}={v} is out of range [{low}, {high if high is not None else 'prompt length'}]")
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

    def images(self, i: int) -> list[Any] | None:
        """Prompt ``i``'s pictures, as SGLang normalises ``image_data``: a single request's list (or one item);
        in a batch one entry per prompt (a list, one item, or None), or one item for every prompt."""
        d = self.image_data
        if d is None or d == []:
            return None
        if not isinstance(d, list):
            return [d]
        if not self.is_batch:
            return d
        if len(d) != self.batch_size:
            raise ValueError(f"image_data has {len(d)} entries for {self.batch_size} prompts; send one per prompt")
        item = d[i]
        return None if item is None else (item if isinstance(item, list) else [item])

    def logprob_options(self, i: int) -> tuple[int, int]:
        """(logprob_start_len, top_logprobs_num) of prompt ``i``."""
        out = []
        for name in ("logprob_start_len", "top_logprobs_num"):
            value = getattr(self, name)
            if isinstance(value, list):
                if len(value) != self.batch_size:
                    raise ValueError(f"{name} has {len(value)} entries for {self.batch_size} prompts")
                value = value[i]
            out.append(int(value))
        return out[0], out[1]


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
