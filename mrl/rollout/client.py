"""The driver's rollout client: token-id prompts and n in, typed samples out.

Each of the ``P * n`` samples is one SGLang ``POST /generate`` (``input_ids``, ``sampling_params``,
``return_logprob``); the n samples of a prompt share an affinity key so they land on one engine.
Responses are read as SGLang returns them: ``output_ids``, ``meta_info.finish_reason.type``,
``meta_info.output_token_logprobs`` = [[logprob, token_id, text|None], ...] and
``meta_info.weight_version``. A sample whose request failed after the router's retries comes back
with ``finish_reason="error"`` and its reason; nothing is dropped.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from mrl.rollout.router import RouteOutcome, Router
from mrl.rollout.types import FINISH_ERROR, RolloutRequest, RolloutResult, RolloutSample


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

    def __init__(self, router: Router) -> None:
        self.router = router

    def generate(self, request: RolloutRequest) -> RolloutResult:
        return self.router.pool.loop.run(self.agenerate(request))

    def generate_ids(self, prompts: Sequence[Sequence[int]], n: int = 1, **sampling_params: Any) -> RolloutResult:
        return self.generate(RolloutRequest([list(p) for p in prompts], n, dict(sampling_params)))

    async def agenerate(self, request: RolloutRequest) -> RolloutResult:
        t0 = time.perf_counter()
        batch_tag = f"{id(request)}-{t0}"

        async def one(i: int, j: int) -> RolloutSample:
            payload = {
                "input_ids": request.prompts[i],
                "sampling_params": request.sampling_params,
                "return_logprob": request.return_logprob,
            }
            out: RouteOutcome = await self.router.generate(payload, (batch_tag, i), request.timeout_s)
            if out.body is None:
                return RolloutSample(i, j, request.prompts[i], [], [], FINISH_ERROR,
                                     engine_url=out.engine_url, error=out.error, attempts=out.attempts)
            try:
                ids, lps, reason, wv = parse_generate_response(out.body)
            except Exception as ex:  # noqa: BLE001 - a malformed answer is a failed sample, reported
                return RolloutSample(i, j, request.prompts[i], [], [], FINISH_ERROR, engine_url=out.engine_url,
                                     error=f"unparseable /generate answer: {ex}", attempts=out.attempts)
            if request.return_logprob and len(lps) != len(ids):
                return RolloutSample(i, j, request.prompts[i], [], [], FINISH_ERROR, engine_url=out.engine_url,
                                     error=f"{len(ids)} output ids but {len(lps)} log-probs", attempts=out.attempts)
            return RolloutSample(i, j, request.prompts[i], ids, lps, reason, wv, out.engine_url, None, out.attempts)

        try:
            samples = await asyncio.gather(
                *(one(i, j) for i in range(len(request.prompts)) for j in range(request.n))
            )
        finally:
            for i in range(len(request.prompts)):
                self.router.forget((batch_tag, i))
        return RolloutResult(list(samples), request.n, time.perf_counter() - t0)
