"""Partial rollouts: generations interrupted by a weight push and continued with the new weights.

slime's ``--partial-rollout`` and verl's fully-async ``partial_rollout`` with SGLang's protocol: the
pusher closes a :class:`SubmitGate` and calls ``/pause_generation {"mode": "abort"}``; every
request in flight then ends with ``finish_reason.type == "abort"`` and the tokens it sampled so far
(``output_ids`` and their log-probs), reported with the engine's weight version of that moment.
:func:`agenerate_resumable` keeps those tokens, each labelled with that version, and once the gate
opens again (the push is done) resubmits ``prompt + tokens so far`` with the remaining budget
(``max_new_tokens - len(tokens so far)``), until every sample ends with ``stop``/``length``. The
response is the concatenation of its segments: no token is lost or repeated (tests/rollout/
test_partial_rollout.py against the embedded engine), and ``RolloutSample.token_weight_versions``
holds the version of every token.

The labels are exact because a segment's tokens all come from one version: the pusher waits until
every segment that entered the gate has returned (:meth:`SubmitGate.wait_drained`) before the
weights change, and none enters while the gate is closed. A segment that could not be drained
(real SGLang holds a request that arrives after the pause in its tokenizer manager until
``/continue_generation``) starts only after the push and reports the new version, which then made
all of its tokens.

What changes for the sample: its log-probs are the engine's of each segment's version, and a
segment's ``sampling_seed`` is the sample's seed advanced per segment (one draw stream per
segment), so a continued sample is not the draw the uninterrupted run would have made. A stop
string spanning a segment boundary is not seen (stop tokens and EOS are).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from mrl.rollout.types import FINISH_ABORT, RolloutRequest, RolloutResult, RolloutSample

#: a sample continued more often than this is an error (each continuation follows one weight push)
MAX_SEGMENTS = 64
_SEED_STRIDE = 1_000_003  # segment s of a sample draws with seed + s * stride (mod 2**31)


def version_number(v: str | None) -> int:
    """An engine's weight version as an int: ``"default"``/None (the start weights) = 0."""
    return 0 if v in (None, "default") else int(v)


class SubmitGate:
    """Between a weight pusher (any thread) and the generation segments (the pool's loop): segments
    enter only while the gate is open; :meth:`close` + :meth:`wait_drained` give the pusher a moment
    with no segment in flight."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._open = True
        self.inflight = 0

    async def enter(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cv:
                if self._open:
                    self.inflight += 1
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"a weight push kept generation paused for more than {timeout_s}s "
                                   "(trainer.async_training.batch_timeout_s)")
            await asyncio.sleep(0.01)

    def leave(self) -> None:
        with self._cv:
            self.inflight -= 1
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._open = False

    def open(self) -> None:
        with self._cv:
            self._open = True

    def wait_drained(self, timeout_s: float, poke: Callable[[], None] | None = None, poke_every_s: float = 0.2) -> bool:
        """Block until no segment is in flight (True) or ``timeout_s`` passed (False); ``poke`` is called
        every ``poke_every_s`` meanwhile (the pusher aborts requests that reached a paused engine)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self.inflight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, poke_every_s))
                if self.inflight > 0 and poke is not None:
                    self._cv.release()
                    try:
                        poke()
                    finally:
                        self._cv.acquire()
        return True


@dataclass
class _Partial:
    """One sample across its segments."""

    first: RolloutSample
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    segments: int = 0
    attempts: int = 0
    last: RolloutSample | None = None

    def add(self, s: RolloutSample) -> None:
        self.segments += 1
        self.attempts += s.attempts
        self.last = s
        if not s.ok:
            return
        self.ids += s.response_ids
        self.lps += s.rollout_log_probs
        self.versions += [s.weight_version or "default"] * s.response_length

    @property
    def interrupted(self) -> bool:
        return self.last is not None and self.last.ok and self.last.finish_reason == FINISH_ABORT

    def sample(self) -> RolloutSample:
        last = self.last
        assert last is not None
        f = self.first
        if not last.ok:
            return replace(last, prompt_index=f.prompt_index, sample_index=f.sample_index, prompt_ids=f.prompt_ids,
                           response_ids=[], rollout_log_probs=[], attempts=self.attempts)
        oldest = min(self.versions, key=version_number) if self.versions else last.weight_version
        # the last segment's prompt is f.prompt_ids + every earlier token: its routed experts cover the sample
        return RolloutSample(f.prompt_index, f.sample_index, f.prompt_ids, self.ids, self.lps, last.finish_reason,
                             oldest, last.engine_url, None, self.attempts, list(self.versions),
                             routed_experts=last.routed_experts)


async def agenerate_resumable(client: Any, request: RolloutRequest, gate: SubmitGate, *,
                              gate_timeout_s: float) -> tuple[RolloutResult, int]:
    """``client.agenerate(request)`` whose interrupted samples are continued until they finish;
    returns the merged result and the number of continuation segments sent."""
    t0 = time.perf_counter()
    await gate.enter(gate_timeout_s)
    try:
        first = await client.agenerate(request)
    finally:
        gate.leave()
    parts = [_Partial(s) for s in first.samples]
    for p, s in zip(parts, first.samples):
        p.add(s)
    budget = int(request.sampling_params.get("max_new_tokens", 128))  # SGLang's default when unset
    sent = 0
    while pending := [p for p in parts if p.interrupted]:
        if any(p.segments >= MAX_SEGMENTS for p in pending):
            raise RuntimeError(f"a sample was interrupted {MAX_SEGMENTS} times; something other than weight pushes "
                               "aborts its requests (see the engine logs)")
        await gate.enter(gate_timeout_s)  # waits while a push runs: the continuation uses the new weights
        try:
            outs = await asyncio.gather(*(client.agenerate(_continuation(request, p, budget)) for p in pending))
        finally:
            gate.leave()
        sent += len(pending)
        for p, out in zip(pending, outs):
            p.add(out.samples[0])
    return RolloutResult([p.sample() for p in parts], request.n, time.perf_counter() - t0), sent


def _continuation(request: RolloutRequest, p: _Partial, budget: int) -> RolloutRequest:
    """prompt + the tokens so far, for the tokens still to come (one sample)."""
    f = p.first
    left = budget - len(p.ids)
    if left <= 0:  # an engine that ends a sample at its budget reports length, not abort
        raise RuntimeError(f"sample {f.prompt_index}/{f.sample_index} was interrupted with its whole budget "
                           f"({budget} tokens) generated")
    seeds = None
    if request.sampling_seeds is not None:
        seeds = [[(request.sampling_seeds[f.prompt_index][f.sample_index] + p.segments * _SEED_STRIDE) % 2**31]]
    return RolloutRequest([f.prompt_ids + p.ids], 1, {**request.sampling_params, "max_new_tokens": left},
                          request.return_logprob, request.timeout_s, seeds)


__all__ = ["MAX_SEGMENTS", "SubmitGate", "agenerate_resumable", "version_number"]
