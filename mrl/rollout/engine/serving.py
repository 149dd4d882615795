"""Request plumbing shared by the engine's client routes (``/generate`` and the OpenAI ``/v1``
routes): expand prompts x ``n`` into scheduler requests, compute prompt log-probs, wait for the
results while watching the client (a client that disconnects aborts its requests, as SGLang
does), stream partial results, and format SGLang's ``/generate`` output.

Output of one sample (SGLang 0.5.23's ``/generate``)::

    {"text": str, "output_ids": [int], "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "weight_version", "e2e_latency",
     # with return_logprob:
     "input_token_logprobs": [[lp|None, id, text|None]], "output_token_logprobs": [...],
     "output_token_logprobs_length": int,
     # with top_logprobs_num > 0 too:
     "input_top_logprobs": [None | [[lp, id, text|None]]], "output_top_logprobs": [[[lp, id, text|None]]],
     # with return_routed_experts, once finished (SGLang's detokenizer: base64 of int32 C-order bytes):
     "routed_experts": b64([seqlen - 1 - routed_experts_start_len, num_hidden_layers, top_k])}}

Streaming (``stream: true``): ``data: {json}`` events with the same dict, cumulative (text so far,
all output ids so far), ``"index"`` added for batch / ``n > 1`` requests, then ``data: [DONE]``.
Partial text holds back an incomplete UTF-8 character and any tail that could begin a stop string,
so the streamed text only ever grows.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest

from mrl.rollout.engine.prompt_logprobs import prompt_logprobs
from mrl.rollout.engine.scheduler import Request
from mrl.rollout.protocol import GREEDY_BELOW

DISCONNECT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there
_FLOAT_MIN = -3.4028234663852886e38  # log-probs are clamped to a JSON-representable float, as SGLang does


@dataclass
class Job:
    """One sample of a request: its scheduler request, prompt log-prob options and results."""

    req: Request
    start: int = -1  # logprob_start_len; -1: no prompt log-probs
    input_lp: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)


def new_job(engine, ids: list[int], params, return_logprob: bool, start: int, top_num: int,
            rid: str | None, routed_experts: bool = False, routed_start: int = 0, vision: Any = None) -> Job:
    """A job for one sample; ``start`` or ``routed_start`` beyond the prompt is refused (SGLang's rules).
    ``vision``: the prompt's pictures (:func:`prepare_images`; ``ids`` are then the expanded ones)."""
    if vision is not None and return_logprob and start >= 0:
        raise ValueError("logprob_start_len >= 0 with image_data: the embedded engine returns no prompt log-probs for "
                         "pictures; send logprob_start_len=-1")
    if return_logprob and start > len(ids):
        raise ValueError(f"logprob_start_len={start} is higher than the number of input tokens ({len(ids)}); "
                         "use a smaller logprob_start_len")
    if routed_experts and not 0 <= routed_start <= len(ids):
        raise ValueError(f"routed_experts_start_len={routed_start} is outside [0, {len(ids)}] (the number of input "
                         "tokens); use a value in that range")
    req = Request(prompt_ids=list(ids), params=params, return_logprob=return_logprob,
                  top_logprobs_num=top_num if return_logprob else 0, return_routed_experts=routed_experts,
                  routed_start=routed_start, vision=vision)
    if rid is not None:
        req.rid = rid
    return Job(req, start if return_logprob else -1)


def prepare_images(engine, ids: list[int], images: list[Any] | None) -> tuple[list[int], Any]:
    """(ids, pictures) of one prompt: a vision-language engine expands its image tokens (engine/vlm.py); a
    text-only one refuses pictures."""
    vision = engine.runner.vision
    if vision is None:
        if images:
            raise ValueError("image_data needs a vision-language model; this engine serves a text-only one")
        return ids, None
    return vision.prepare(ids, images or [])


def encode(engine, text: str) -> list[int]:
    tok = engine.runner.tokenizer
    if tok is None:
        raise ValueError("'text' needs a tokenizer in the model directory; send input_ids instead")
    return tok.encode(text)


async def run(engine, jobs: list[Job]) -> None:
    """Submit every job, all or nothing (``Scheduler.submit_many``: a refused one, whose error names the
    bad field, queues none), then compute prompt log-probs (one forward per distinct prompt, under the
    model lock) while they decode."""
    sched = engine.scheduler
    sched.submit_many([j.req for j in jobs])
    need = [j for j in jobs if 0 <= j.start < len(j.req.prompt_ids)]
    if not need:
        return

    def _forward() -> None:
        seen: dict[tuple, tuple] = {}
        with sched.model_lock:
            for j in need:
                temp = j.req.params.temperature
                key = (tuple(j.req.prompt_ids), j.start, temp, j.req.top_logprobs_num)
                if key not in seen:
                    seen[key] = prompt_logprobs(engine.runner, j.req.prompt_ids, j.start,
                                                temp if temp >= GREEDY_BELOW else 0.0, j.req.top_logprobs_num)
                j.input_lp, j.input_top = seen[key]

    try:
        await asyncio.to_thread(_forward)
    except BaseException:
        abort_soon(engine, jobs, "prompt log-probs failed")
        raise


def abort_soon(engine, jobs: list[Job], message: str = "client disconnected") -> None:
    """Abort the unfinished jobs off the event loop (abort may wait for a step to end)."""
    rids = {j.req.rid for j in jobs if not j.req.future.done()}
    if rids:  # one scan of the queue for all of them (one per id took minutes for 10^5 samples)
        asyncio.get_running_loop().run_in_executor(None, lambda: engine.scheduler.abort_many(rids, message=message))


async def wait_all(engine, http: HTTPRequest | None, jobs: list[Job]) -> bool:
    """Wait for every job; False (jobs aborted) when the client went away first."""
    pending = {asyncio.wrap_future(j.req.future) for j in jobs}
    while pending:
        _, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S)
        if pending and http is not None and await http.is_disconnected():
            abort_soon(engine, jobs)
            return False
    for j in jobs:
        j.req.future.result()  # re-raise a failed step
    return True


async def watch(engine, http: HTTPRequest | None, jobs: list[Job]) -> AsyncIterator[list[int]]:
    """Yield the indices of jobs that progressed (new tokens or finished), until all finished;
    aborts the unfinished ones when the consumer stops early or the client disconnects."""
    loop = asyncio.get_running_loop()
    ev = asyncio.Event()

    def poke(_: Any = None) -> None:
        try:
            loop.call_soon_threadsafe(ev.set)
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    for j in jobs:
        j.req.on_token = poke
        j.req.future.add_done_callback(poke)
    ev.set()  # tokens may have come before the hooks were set
    seen = [-1] * len(jobs)
    done = [False] * len(jobs)
    try:
        while not all(done):
            try:
                await asyncio.wait_for(ev.wait(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                if http is not None and await http.is_disconnected():
                    return
                continue
            ev.clear()
            moved = []
            for k, j in enumerate(jobs):
                if done[k]:
                    continue
                fin, n = j.req.future.done(), len(j.req.output_ids)
                if fin or n > seen[k]:
                    seen[k], done[k] = n, fin
                    moved.append(k)
            if moved:
                yield moved
    finally:
        if not all(done):
            abort_soon(engine, jobs)


async def progress(engine, http: HTTPRequest | None, jobs: list[Job]) -> AsyncIterator[tuple[int, str | None]]:
    """(k, None) for each job that progressed, (k, an SSE error event) for one whose engine step
    failed; closing this generator (or a client disconnect) aborts the unfinished jobs (``watch``)."""
    async with contextlib.aclosing(watch(engine, http, jobs)) as moved_lists:
        async for moved in moved_lists:
            for k in moved:
                err = failure(jobs[k])
                yield k, (sse(err) if err is not None else None)


def output_text(engine, r: Request, ids: list[int], final: bool) -> str:
    """Decoded output; a final one is trimmed at its stop (SGLang's rules), a partial one holds
    back what may still change (see the module docstring)."""
    tok = engine.runner.tokenizer
    if tok is None or not ids:
        return ""
    p = r.params
    fr = (r.finish_reason or {}) if final else {}
    if fr.get("type") == "stop" and isinstance(fr.get("matched"), int) and not p.no_stop_trim:
        ids = ids[:-1]
    text = tok.decode(ids, skip_special_tokens=p.skip_special_tokens)
    if final:
        if fr.get("type") == "stop" and isinstance(fr.get("matched"), str) and not p.no_stop_trim:
            cut = text.find(fr["matched"])  # SGLang: a regex stop is searched literally, so rarely cut
            text = text[:cut] if cut >= 0 else text
        return text
    text = text.rstrip("\ufffd")
    hold = 0
    for s in p.stop_strings:
        for i in range(min(len(s), len(text)), 0, -1):
            if text.endswith(s[:i]):
                hold = max(hold, i)
                break
    return text[: len(text) - hold]


def lp_entries(engine, pairs, with_text: bool) -> list[list[Any]]:
    """[(logprob, id)] -> SGLang's [[logprob, id, text|None]] (log-probs finite, like SGLang's clamp)."""
    pairs = list(pairs)
    texts = [None] * len(pairs)
    if with_text and engine.runner.tokenizer is not None and pairs:
        texts = engine.runner.tokenizer.batch_decode([[t] for _, t in pairs])
    return [[None if lp is None else (lp if math.isfinite(lp) else (_FLOAT_MIN if lp < 0 else -_FLOAT_MIN)),
             t, s] for (lp, t), s in zip(pairs, texts)]


def native_output(engine, job: Job, t0: float, with_text: bool, final: bool = True) -> dict[str, Any]:
    """SGLang's ``/generate`` dict for one sample (see the module docstring)."""
    r = job.req
    ids = list(r.output_ids)
    n = min(len(ids), len(r.logprobs))
    ids = ids[:n] if not final else ids
    meta: dict[str, Any] = {
        "id": r.rid, "finish_reason": r.finish_reason if final else None, "prompt_tokens": len(r.prompt_ids),
        "completion_tokens": len(ids), "cached_tokens": 0,
        "weight_version": engine.scheduler.weight_version, "e2e_latency": time.monotonic() - t0,
    }
    if r.return_logprob:
        meta["input_token_logprobs"] = lp_entries(engine, job.input_lp, with_text)
        meta["output_token_logprobs"] = lp_entries(engine, zip(r.logprobs[: len(ids)], ids), with_text)
        meta["output_token_logprobs_length"] = len(ids)
        if r.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [None if e is None else lp_entries(engine, e, with_text) for e in job.input_top]
            meta["output_top_logprobs"] = [lp_entries(engine, e, with_text) for e in r.top_logprobs[: len(ids)]]
    if r.return_routed_experts and final:  # SGLang collects them when the request finishes
        meta["routed_experts"] = encode_routed_experts(r.routed_experts()[r.routed_start:])
    return {"text": output_text(engine, r, ids, final), "output_ids": ids, "meta_info": meta}


def encode_routed_experts(ids) -> str:
    """SGLang's ``_b64_encode_per_request``: base64 of the tensor's bytes (int32, C order, native = little
    endian), decoded by ``np.frombuffer(base64.b64decode(s), dtype=np.int32)``."""
    return base64.b64encode(ids.contiguous().numpy().tobytes()).decode("utf-8")


def failure(job: Job) -> dict[str, Any] | None:
    """SGLang's error event for a sample whose engine step failed (None if it did not)."""
    f = job.req.future
    if not f.done() or f.exception() is None:
        return None
    return {"error": {"message": f"engine step failed: {f.exception()}", "type": "internal_error", "code": 500}}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, allow_nan=False)}\n\n"
