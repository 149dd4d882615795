"""The driver's rollout client: token-id prompts and n in, typed samples out.

A request's prompts are cut into one SGLang batch ``POST /generate`` per healthy engine, or into
requests of at most ``PROMPTS_PER_REQUEST`` prompts when there are more (behind SGLang's router, whose
pool is the router alone, one request per prompt, which the router balances) (``input_ids``
= each prompt of the chunk n times, ``sampling_params`` one map or one per sample, ``return_logprob``),
answered by a list of results in the same order; the router's least-outstanding pick sends the
chunks one per engine. Whole prompts stay in one chunk, so the n samples of a prompt land on one
engine (its prefix is computed once there). The per-request cost of HTTP is paid once per engine:
per-sample requests (the first design) cost the engine more CPU than the decoding (docs/performance.md,
'One request per engine'). A failed request fails (and is
retried for) all the samples of its chunk. Responses are read as SGLang returns them: ``output_ids``,
``meta_info.finish_reason.type``, ``meta_info.output_token_logprobs`` = [[logprob, token_id,
text|None], ...] and ``meta_info.weight_version``. With ``RolloutRequest.sampling_seeds`` every
sample carries its own SGLang ``sampling_seed`` (``sampling_params`` becomes a list of dicts; behind a
route that takes one map per request, seeded samples go one request each). A sample whose request
failed after the router's retries comes back with ``finish_reason="error"`` and its reason;
nothing is dropped.

Pictures (vision-language models, docs/vision.md): with ``RolloutRequest.image_data`` every body carries
SGLang's ``image_data`` next to ``input_ids`` (one list of base64 PNG strings or paths per sample, [] for a
sample without pictures), and each prompt holds one image token per picture, which the engine expands.

Routed experts (MoE routing replay): with ``return_routed_experts=True`` every ``/generate`` asks for them
(SGLang's ``return_routed_experts``; the engines must run with ``--enable-return-routed-experts``) and each
sample carries ``RolloutSample.routed_experts``, decoded as SGLang's own client does (base64 -> int32) and
shaped ``[len(prompt) + len(response) - 1, num_layers, top_k]`` with ``routed_experts_layout``. An answer
without them, or with a size that does not fit, makes a failed sample that says why (SGLang started
without the flag silently leaves them out).
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mrl.rollout.router import RouteOutcome, Router
from mrl.rollout.types import (
    FINISH_ABORT,
    FINISH_ERROR,
    RolloutRequest,
    RolloutResult,
    RolloutSample,
    RoutedExpertsLayout,
)

# Prompts per /generate at most: answers of finished requests are parsed while the rest still generate
# (a single answer per engine for a large batch would be one multi-hundred-MB JSON parsed at the end).
PROMPTS_PER_REQUEST = 32


def parse_generate_response(body: dict[str, Any]) -> tuple[list[int], list[float], str, str | None]:
    """(response_ids, log_probs, finish_reason, weight_version) from one /generate answer."""
    meta = body.get("meta_info") or {}
    lp = meta.get("output_token_logprobs") or []
    ids = body.get("output_ids")
    if ids is None:
        ids = [int(x[1]) for x in lp]
    fr = meta.get("finish_reason")
    reason = fr.get("type") if isinstance(fr, dict) else (fr or "unknown")
    wv = meta.get("weight_version")
    return list(ids), [float(x[0]) for x in lp], str(reason), None if wv is None else str(wv)


class RolloutClient:
    """Sync facade over ``Router`` for the driver (network work runs on the pool's loop)."""

    def __init__(self, router: Router, params_list_in_batch: bool = True, prompts_per_request: int | None = None,
                 return_routed_experts: bool = False, routed_experts_layout: RoutedExpertsLayout | None = None) -> None:
        """params_list_in_batch: the route accepts one ``sampling_params`` per sample of a batch
        request (SGLang and the embedded engine do; sglang-router's /generate schema takes one map),
        else seeded samples of a prompt go as n single requests. prompts_per_request: None = one
        request per healthy engine of the pool (at most PROMPTS_PER_REQUEST prompts each); 1 behind
        SGLang's router, whose pool is the router alone: it balances requests, so they must be many.
        return_routed_experts: every sample carries the engine's routed experts (MoE models; see the module
        docstring); needs ``routed_experts_layout`` (``RoutedExpertsLayout.from_hf_config(model path)``)."""
        if return_routed_experts and routed_experts_layout is None:
            raise ValueError("RolloutClient(return_routed_experts=True) needs routed_experts_layout="
                             "RoutedExpertsLayout.from_hf_config(<model path>)")
        self.router = router
        self.params_list_in_batch = params_list_in_batch
        self.prompts_per_request = prompts_per_request
        self.return_routed_experts = return_routed_experts
        self.routed_experts_layout = routed_experts_layout

    def generate(self, request: RolloutRequest) -> RolloutResult:
        return self.router.pool.loop.run(self.agenerate(request))

    def generate_ids(self, prompts: Sequence[Sequence[int]], n: int = 1, **sampling_params: Any) -> RolloutResult:
        return self.generate(RolloutRequest([list(p) for p in prompts], n, dict(sampling_params)))

    async def agenerate(self, request: RolloutRequest) -> RolloutResult:
        t0 = time.perf_counter()
        n = request.n

        async def send(part: list[tuple[int, list[int]]]) -> list[RolloutSample]:
            """Samples ``js`` of each prompt ``i`` in ``part`` as one /generate (a batch when more than one)."""
            flat = [(i, j) for i, js in part for j in js]
            k = len(flat)
            params: dict[str, Any] | list[dict[str, Any]] = request.sampling_params
            if request.sampling_seeds is not None:  # one sampling_params per sample of the batch (SGLang accepts a list)
                seeded = [{**params, "sampling_seed": int(request.sampling_seeds[i][j])} for i, j in flat]
                params = seeded if k > 1 else seeded[0]
            ids = [request.prompts[i] for i, _ in flat]
            payload = {
                "input_ids": ids if k > 1 else ids[0],
                "sampling_params": params,
                "return_logprob": request.return_logprob,
            }
            if request.image_data is not None:
                # SGLang's batch form is one list of images per sample ([] = none); a single request's is its list
                images = [list(request.image_data[i]) for i, _ in flat]
                if k > 1 and any(images):
                    payload["image_data"] = images
                elif k == 1 and images[0]:
                    payload["image_data"] = images[0]
            if self.return_routed_experts:
                payload["return_routed_experts"] = True
            out: RouteOutcome = await self.router.generate(payload, None, request.timeout_s)

            def failed(error: str | None) -> list[RolloutSample]:
                return [RolloutSample(i, j, request.prompts[i], [], [], FINISH_ERROR, engine_url=out.engine_url,
                                      error=error, attempts=out.attempts) for i, j in flat]
            if out.body is None:
                return failed(out.error)
            answers = out.body if k > 1 else [out.body]
            if not isinstance(answers, list) or len(answers) != k:
                got = f"a list of {len(answers)}" if isinstance(answers, list) else type(answers).__name__
                return failed(f"/generate with a batch of {k} answered {got}, not a list of {k}")
            layout = self.routed_experts_layout if self.return_routed_experts else None
            return [_sample(i, j, request.prompts[i], a, out, request.return_logprob, layout)
                    for (i, j), a in zip(flat, answers)]

        P = len(request.prompts)
        if P == 0:
            parts = []
        elif request.sampling_seeds is not None and not self.params_list_in_batch:
            # one sampling_params per request: the seeded samples go one by one
            parts = [[(i, [j])] for i in range(P) for j in range(n)]
        else:
            # One request per engine (more when an engine would get over PROMPTS_PER_REQUEST prompts), each
            # with whole prompts (their n samples share the engine and its prefix work); the router's
            # least-outstanding pick spreads them over the engines.
            if self.prompts_per_request is not None:
                chunks = math.ceil(P / self.prompts_per_request)
            else:
                engines = max(1, sum(e.healthy for e in self.router.pool.engines))
                chunks = max(engines, math.ceil(P / PROMPTS_PER_REQUEST))
            chunks = min(P, chunks)
            bounds = [P * c // chunks for c in range(chunks + 1)]
            parts = [[(i, list(range(n))) for i in range(a, b)] for a, b in itertools.pairwise(bounds) if b > a]
        outs = await asyncio.gather(*(send(part) for part in parts))
        return RolloutResult([s for o in outs for s in o], n, time.perf_counter() - t0)  # parts are in (i, j) order


def decode_routed_experts(encoded: str, rows: int, layout: RoutedExpertsLayout) -> torch.Tensor:
    """``meta_info["routed_experts"]`` -> int32 ``[rows, num_layers, top_k]``: SGLang's own decode
    (``extract_routed_experts_from_meta_info``: base64 -> ``np.frombuffer(dtype=np.int32)``), then the
    shape; ValueError when the size does not fit."""
    flat = np.frombuffer(base64.b64decode(encoded.encode("utf-8")), dtype=np.int32)
    want = rows * layout.num_layers * layout.top_k
    if flat.size != want:
        raise ValueError(f"routed_experts holds {flat.size} ids, expected {rows} tokens x {layout.num_layers} layers "
                         f"x top-{layout.top_k} = {want} (does routed_experts_layout match the served model?)")
    return torch.from_numpy(flat.copy()).view(rows, layout.num_layers, layout.top_k)


def _sample(i: int, j: int, prompt: list[int], body: Any, out: RouteOutcome, want_logprob: bool,
            routed_layout: RoutedExpertsLayout | None = None) -> RolloutSample:
    """Sample j of prompt i from its /generate answer (malformed answers become failed samples)."""
    def failed(error: str) -> RolloutSample:
        return RolloutSample(i, j, prompt, [], [], FINISH_ERROR, engine_url=out.engine_url, error=error,
                             attempts=out.attempts)
    try:
        ids, lps, reason, wv = parse_generate_response(body)
    except Exception as ex:  # noqa: BLE001 - a malformed answer is a failed sample, reported
        return failed(f"unparseable /generate answer: {ex}")
    if want_logprob and len(lps) != len(ids):
        return failed(f"{len(ids)} output ids but {len(lps)} log-probs")
    routed = None
    if routed_layout is not None:
        encoded = (body.get("meta_info") or {}).get("routed_experts")
        error = None
        if not isinstance(encoded, str):
            error = ("the engine answered without meta_info.routed_experts: start SGLang (or mrl engine) with "
                     "--enable-return-routed-experts, and serve an MoE model")
        else:
            try:
                routed = decode_routed_experts(encoded, max(0, len(prompt) + len(ids) - 1), routed_layout)
            except ValueError as ex:  # binascii.Error is a ValueError too
                error = f"meta_info.routed_experts: {ex}"
        # An aborted request (a weight push's pause) may have been dropped before it ran, with no routing to
        # report; partial rollouts continue it, and the continuation's routing covers the whole sample.
        if error is not None and reason != FINISH_ABORT:
            return failed(error)
    return RolloutSample(i, j, prompt, ids, lps, reason, wv, out.engine_url, None, out.attempts,
                         routed_experts=routed)
