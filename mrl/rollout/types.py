"""Typed records at the rollout boundary: what the driver asks for and what comes back.

Units (ARCHITECTURE.md; docs/config.md has the batch vocabulary): a *prompt* is one row of the dataset; a *sample* is one generated
response; a request of P prompts with ``n`` samples each yields ``P * n`` samples, ordered
prompt-major and interleaved like verl's ``repeat(n, interleave=True)``:
``samples[i * n + j]`` is sample ``j`` of prompt ``i``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

#: finish reasons as SGLang reports them in ``meta_info.finish_reason.type``, plus ``error``
#: for a sample that failed after all retries (never dropped, see RolloutResult.failed).
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


@dataclass(frozen=True)
class RolloutRequest:
    """One batch for the engine pool.

    prompts: P token-id lists (ragged). n: samples per prompt. sampling_params: SGLang's
    ``sampling_params`` dict (temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids,
    ignore_eos, ...), sent unchanged to every engine. timeout_s: per-request (per-sample) limit.
    sampling_seeds: optional [P][n] SGLang ``sampling_seed`` per sample (reproducible draws).
    """

    prompts: list[list[int]]
    n: int = 1
    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = True
    timeout_s: float | None = None
    sampling_seeds: list[list[int]] | None = None
    #: per prompt, ``extra_info.tools_kwargs`` of its row (agent rollouts: keyword arguments bound to
    #: that row's tool calls, mrl/agent/loop.py); None = no row has any
    tools_kwargs: list[dict[str, Any] | None] | None = None
    #: per prompt, its pictures as SGLang's ``image_data`` items (base64 PNG strings or paths the engine can
    #: read; [] for a prompt without any), in the order of the prompt's image tokens; ``prompts`` then hold one
    #: image token per picture (the engine expands it, docs/vision.md). None = a text-only request
    image_data: list[list[str]] | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"RolloutRequest.n must be >= 1, got {self.n}; set rollout.n to a positive int")
        for i, p in enumerate(self.prompts):
            if len(p) == 0:
                raise ValueError(f"RolloutRequest.prompts[{i}] is empty; every prompt needs >= 1 token id")
        if self.sampling_seeds is not None and (len(self.sampling_seeds) != len(self.prompts)
                                                or any(len(s) != self.n for s in self.sampling_seeds)):
            raise ValueError(f"RolloutRequest.sampling_seeds must be {len(self.prompts)} lists of n={self.n} seeds")
        if self.image_data is not None and (len(self.image_data) != len(self.prompts)
                                            or not all(isinstance(x, list) for x in self.image_data)):
            raise ValueError(f"RolloutRequest.image_data must be {len(self.prompts)} lists of images (one per prompt)")


@dataclass(frozen=True)
class RoutedExpertsLayout:
    """Shape of one token's routed experts as an engine returns them (SGLang's capture buffer): one row of
    ``top_k`` expert ids for each of the ``num_layers`` hidden layers (a dense layer's row is all 0)."""

    num_layers: int
    top_k: int

    @classmethod
    def from_hf_config(cls, model_path: str | os.PathLike) -> RoutedExpertsLayout:
        """From ``model_path/config.json`` (``num_hidden_layers``, ``num_experts_per_tok``; a nested
        ``text_config`` for multimodal wrappers)."""
        path = os.path.join(model_path, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        if "num_experts_per_tok" not in cfg:
            raise ValueError(f"{path}: no num_experts_per_tok, not a mixture-of-experts model; routed experts "
                             "exist only for MoE models (turn routing replay off)")
        return cls(int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"]))


@dataclass
class RolloutSample:
    """One generated response. ``rollout_log_probs[t]`` is log p(response_ids[t]) under the
    engine's sampling distribution (same temperature semantics as the trainer's compute_log_prob).
    A failed sample has ``finish_reason == "error"``, empty responses and ``error`` set."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    finish_reason: str
    weight_version: str | None = None
    engine_url: str | None = None
    error: str | None = None
    attempts: int = 1
    #: per response token, the weight version that sampled it; set when a partial rollout continued the
    #: sample across weight pushes (mrl/rollout/partial.py), None = every token is ``weight_version``'s
    token_weight_versions: list[str] | None = None
    #: multi-turn (agent) samples: per response token, 1 where the engine sampled it (it enters the
    #: loss, with its engine log-prob) and 0 on tool-result / chat-template tokens the driver appended
    #: (their log-prob slot is 0); None = every response token was sampled
    loss_mask: list[int] | None = None
    #: multi-turn (agent) samples: turns, tool-call history and final answer (mrl/agent/loop.py), which
    #: the reward function sees as ``extra_info["agent"]``
    agent: dict[str, Any] | None = None
    #: MoE models, when the client asked for them (``RolloutClient(return_routed_experts=True)``): int32
    #: ``[len(prompt_ids) + len(response_ids) - 1, num_layers, top_k]``; row t holds the top-k expert ids
    #: (in the router's top-k order) of every hidden layer for token t of ``prompt_ids + response_ids`` — the
    #: experts the engine's forward used when it fed that token. The last response token has no row (it is
    #: sampled, never fed: SGLang's ``[0, seqlen - 1)``); dense layers' rows are 0. A partially rolled-out
    #: sample (mrl/rollout/partial.py) holds its last segment's, whose prefill re-routed the earlier tokens
    #: with the newest weights. None = not asked for (or a failed sample).
    routed_experts: torch.Tensor | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def token_versions(self) -> list[str | None]:
        """The weight version of every response token."""
        if self.token_weight_versions is not None:
            return list(self.token_weight_versions)
        return [self.weight_version] * len(self.response_ids)


@dataclass
class RolloutResult:
    """All ``P * n`` samples of a request (failed ones included, flagged) plus timing."""

    samples: list[RolloutSample]
    n: int
    timing_s: float = 0.0

    @property
    def failed(self) -> list[RolloutSample]:
        return [s for s in self.samples if not s.ok]

    @property
    def weight_versions(self) -> set[str | None]:
        return {s.weight_version for s in self.samples if s.ok}

    @property
    def response_lengths(self) -> list[int]:
        return [s.response_length for s in self.samples]

    @property
    def finish_reasons(self) -> list[str]:
        return [s.finish_reason for s in self.samples]

    def to_padded(self, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-padded tensors for the trainer, B = P * n samples, R = longest response:
        responses [B, R] (long), rollout_log_probs [B, R] (float32, 0 on padding),
        response_attention [B, R] (1 on real tokens), response_mask [B, R] (1 on real tokens the
        engine sampled: multi-turn tool/template tokens are 0), response_lengths [B]."""
        r = max([s.response_length for s in self.samples] + [1])
        # Rows as padded Python lists, one tensor per field: a slice assignment per sample was the driver's
        # hot spot (docs/performance.md, 'Rollout batch assembly').
        resp_rows, logp_rows, mask_rows, attn_rows = [], [], [], []
        for s in self.samples:
            k, pad = s.response_length, r - s.response_length
            if s.loss_mask is not None and len(s.loss_mask) != k:
                raise ValueError(f"sample ({s.prompt_index}, {s.sample_index}): loss_mask has "
                                 f"{len(s.loss_mask)} entries for {k} response tokens")
            if s.rollout_log_probs and len(s.rollout_log_probs) != k:
                raise ValueError(f"sample ({s.prompt_index}, {s.sample_index}): {len(s.rollout_log_probs)} "
                                 f"rollout log-probs for {k} response tokens")
            resp_rows.append(list(s.response_ids) + [pad_token_id] * pad)
            attn_rows.append([1] * k + [0] * pad)
            mask_rows.append((list(s.loss_mask) if s.loss_mask is not None else [1] * k) + [0] * pad)
            logp_rows.append((list(s.rollout_log_probs) if s.rollout_log_probs else [0.0] * k) + [0.0] * pad)
        b = len(self.samples)
        resp = torch.tensor(resp_rows, dtype=torch.long).reshape(b, r)
        logp = torch.tensor(logp_rows, dtype=torch.float32).reshape(b, r)
        mask = torch.tensor(mask_rows, dtype=torch.long).reshape(b, r)
        attn = torch.tensor(attn_rows, dtype=torch.long).reshape(b, r)
        return {
            "responses": resp,
            "rollout_log_probs": logp,
            "response_mask": mask,
            "response_attention": attn,
            "response_lengths": torch.tensor(self.response_lengths, dtype=torch.long),
        }

    def routed_experts_padded(self, prompt_width: int) -> torch.Tensor:
        """The samples' routed experts aligned with the trainer's ``input_ids`` = [prompt left-padded to
        ``prompt_width`` | response right-padded to R = the longest response] (mrl/driver/batch.py):
        int32 ``[B, prompt_width + R, num_layers, top_k]``; column c of sample b holds the experts of the
        token in column c. -1 where the engine gave none: padding columns, each sample's last response token
        (never fed to the engine) and failed samples. Every sample that succeeded must carry them."""
        r = max([s.response_length for s in self.samples] + [1])
        shapes = {tuple(s.routed_experts.shape[1:]) for s in self.samples if s.routed_experts is not None}
        if len(shapes) != 1:
            raise ValueError("routed_experts_padded: no sample carries routed experts (ask the client with "
                             "return_routed_experts=True)" if not shapes else f"routed experts of shapes {shapes}")
        (layers, k), = shapes
        out = torch.full((len(self.samples), prompt_width + r, layers, k), -1, dtype=torch.int32)
        for b, s in enumerate(self.samples):
            if not s.ok:
                continue
            if s.routed_experts is None:
                raise ValueError(f"sample ({s.prompt_index}, {s.sample_index}) has no routed experts")
            if len(s.prompt_ids) > prompt_width:
                raise ValueError(f"sample ({s.prompt_index}, {s.sample_index}): prompt of {len(s.prompt_ids)} "
                                 f"tokens is wider than prompt_width={prompt_width}")
            c0 = prompt_width - len(s.prompt_ids)
            out[b, c0: c0 + s.routed_experts.shape[0]] = s.routed_experts
        return out
