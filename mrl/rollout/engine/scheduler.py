"""Continuous batching: a background thread that admits waiting requests into the running set
between decode steps and retires sequences the step they finish.

One loop iteration: (1) admit up to ``max_running - running`` waiting requests with one batched
prefill, sample their first token and merge them into the running cache — while rows run, only
once ``min_admit`` slots are free (or the queue fits): under steady load a row finishes almost
every step, and a prefill per finished row would read every weight once more for one prompt
(docs/performance.md, 'Admission in groups'); (2) one batched decode
step over every running sequence; (3) finished rows leave the cache at once (their futures are
resolved) so the next step costs only what is still running. The loop holds ``model_lock`` for
the duration of a step; weight updates take the same lock, so they land between two steps and
never under a forward.

Finish rules (SGLang semantics): EOS (unless ``ignore_eos``) or a ``stop_token_ids`` hit ->
``{"type": "stop", "matched": token_id}``; a ``stop`` string in the decoded output ->
``{"type": "stop", "matched": str}``; a ``stop_regex`` pattern found in the decoded tail of the
output -> ``{"type": "stop", "matched": pattern}``; ``max_new_tokens`` reached (or the model's
``max_position_embeddings``) -> ``{"type": "length", "length": n}``; ``/abort_request`` ->
``{"type": "abort", "message": ...}``. The matched stop token stays in ``output_ids`` (and its
log-prob in ``output_token_logprobs``); text is trimmed at the stop string unless ``no_stop_trim``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import regex
import torch

from mrl.rollout.engine.fair_queue import FairQueue
from mrl.rollout.engine.model_runner import ModelRunner
from mrl.rollout.engine.sampling import RowSampling, sample, top_logprobs
from mrl.rollout.protocol import GREEDY_BELOW, SamplingParams

REGEX_TAIL_TOKENS = 64  # output tokens decoded for a stop_regex search (at least)
# One stop_regex search may take this long: `regex` (backtracking, like re) stops a catastrophic pattern
# such as (.*.*)*@ there instead of holding the scheduler thread (and every request) for ever.
REGEX_TIMEOUT_S = 0.05


class RequestTooLarge(ValueError):
    """A request over a per-request limit (``EngineLimits``): it can never be served as sent (HTTP 400)."""


class EngineBusy(ValueError):
    """The engine's queue is full (``EngineLimits``): retry later (HTTP 503)."""


@dataclass(frozen=True)
class EngineLimits:
    """What one client can ask of the engine. A request over ``max_request_samples`` or a prompt over
    ``max_prompt_tokens`` is refused; one that would take the queue past ``max_queued_samples`` or
    ``max_queued_tokens`` (prompt + max_new_tokens per sample, waiting and running) is refused while the
    queue is that full. 0 = no limit (the prompt: the model's context). The defaults stay above what
    mrl's rollout client sends (at most 32 prompts x n samples per request) and below what exhausts a host."""

    max_request_samples: int = 16384
    max_queued_samples: int = 65536
    max_queued_tokens: int = 0
    max_prompt_tokens: int = 0

# Request ids: 32 hex digits like SGLang's uuid4().hex, unique per server: a random per-process prefix
# and a counter. uuid4 reads the OS's random source per call, a visible share of the engine's CPU
# (docs/performance.md, 'Request ids from a counter'), for ids nobody needs to be unguessable.
_RID_PREFIX = os.urandom(8).hex()
_RID_COUNTER = itertools.count()


def new_rid() -> str:
    return f"{_RID_PREFIX}{next(_RID_COUNTER):016x}"


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    rid: str = field(default_factory=new_rid)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    aborted: str | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    sampling: RowSampling | None = None
    # Top log-probs of each output position ([(logprob, token_id)] * top_logprobs_num).
    top_logprobs_num: int = 0
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Called (on the scheduler thread) after each token is appended: streaming responses.
    on_token: Callable[[Request], None] | None = None
    # Set by Scheduler.submit when no stop string or pattern needs the decoded text: the token ids that
    # stop this request and its output length limit (max_new_tokens or the model's context).
    stop_ids: frozenset[int] | None = None
    max_len: int = 0
    # return_routed_experts: the top-k expert ids of every token fed to the model, int32 [1 or n, layers, top_k]
    # chunks in feeding order (a prefill's rows, then one per decode step; a retracted request's re-prefill
    # replaces them). At finish they cover prompt + output[:-1]: the last sampled token is never fed.
    return_routed_experts: bool = False
    routed_start: int = 0  # routed_experts_start_len: the first position returned
    routed: list[torch.Tensor] = field(default_factory=list)
    stop_patterns: list[Any] = field(default_factory=list)  # compiled stop_regex_list (the `regex` module)
    # a vision-language request's pictures (engine/vlm.py: VisionInputs); prompt_ids then hold every image token
    vision: Any = None

    def routed_experts(self) -> torch.Tensor:
        """int32 ``[len(prompt) + len(output) - 1, num_layers, top_k]`` once finished (SGLang's rows)."""
        return torch.cat(self.routed) if self.routed else torch.zeros(0, 0, 0, dtype=torch.int32)


class Scheduler:
    """Owns the running batch and the model during steps. Thread-safe public methods."""

    def __init__(self, runner: ModelRunner, max_running: int = 64, seed: int = 0,
                 min_admit: int | None = None, limits: EngineLimits | None = None) -> None:
        if max_running < 1:
            raise ValueError(f"--max-running must be >= 1, got {max_running}")
        self.runner = runner
        self.max_running = max_running
        # Free slots that trigger an admission while rows run (see the module docstring).
        self.min_admit = max(1, max_running // 8) if min_admit is None else max(1, min_admit)
        self.default_gen = torch.Generator(device="cpu").manual_seed(seed)
        self.weight_version = "default"
        self.model_lock = threading.RLock()
        self._cv = threading.Condition()
        self._waiting = FairQueue()  # one FIFO per submit, admitted round robin (fair_queue.py)
        self.limits = limits or EngineLimits(0, 0, 0, 0)  # in a trainer rank: the trainer's own requests
        self._queued = [0, 0]  # samples, tokens submitted and not finished (for the limits)
        self._count_lock = threading.Lock()
        self._rows: list[Request] = []
        self._rb = runner.new_batch()
        self._paused = False
        self._stop = False
        self._thread: threading.Thread | None = None
        # Counters the tests assert on (batching happened) and /get_server_info reports.
        self.stats = collections.Counter()

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mrl-engine-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- requests -----------------------------------------------------------------------
    def submit(self, req: Request) -> concurrent.futures.Future:
        self.submit_many([req])
        return req.future

    def submit_many(self, reqs: list[Request]) -> None:
        """Queue ``reqs`` together, all or nothing: each is checked first (a ValueError names the bad
        field and queues none), then all enter the queue under one lock, so the loop admits them in one
        prefill. Queued one by one, the loop wakes at the first and prefills whatever has arrived while
        the caller is still queueing the rest (seen in a trainer rank: a 128-sample request admitted as
        25 + 103, two prefills and a decode step more)."""
        lim = self.limits
        if lim.max_request_samples and len(reqs) > lim.max_request_samples:
            raise RequestTooLarge(f"{len(reqs)} samples in one request (prompts x n) is over this engine's "
                                  f"{lim.max_request_samples} (--max-request-samples); send smaller requests")
        ready = [r for r in reqs if self._prepare(r)]
        tokens = sum(len(r.prompt_ids) + r.params.max_new_tokens for r in ready)
        with self._count_lock:
            samples, queued_tokens = self._queued
            if lim.max_queued_samples and samples + len(ready) > lim.max_queued_samples:
                raise EngineBusy(f"the engine has {samples} samples queued or running; {len(ready)} more would pass "
                                 f"its {lim.max_queued_samples} (--max-queued-samples); retry later")
            if lim.max_queued_tokens and queued_tokens + tokens > lim.max_queued_tokens:
                raise EngineBusy(f"the engine has {queued_tokens} tokens queued or running; {tokens} more would pass "
                                 f"its {lim.max_queued_tokens} (--max-queued-tokens); retry later")
            self._queued[0] += len(ready)
            self._queued[1] += tokens
        for r in ready:
            r.future.add_done_callback(functools.partial(self._done, r))
        with self._cv:
            self._waiting.extend(ready)
            self.stats["submitted"] += len(ready)
            self._cv.notify_all()

    def _done(self, r: Request, _future: concurrent.futures.Future) -> None:
        with self._count_lock:
            self._queued[0] -= 1
            self._queued[1] -= len(r.prompt_ids) + r.params.max_new_tokens

    def _prepare(self, req: Request) -> bool:
        """Check ``req`` and set its sampling state; False when it is already finished (max_new_tokens 0)."""
        max_pos = self.runner.max_positions
        if not req.prompt_ids:
            raise ValueError("empty prompt: input_ids/text must hold at least one token")
        if len(req.prompt_ids) >= max_pos:
            raise ValueError(f"prompt of {len(req.prompt_ids)} tokens does not fit max_position_embeddings={max_pos}")
        if self.limits.max_prompt_tokens and len(req.prompt_ids) > self.limits.max_prompt_tokens:
            raise RequestTooLarge(f"prompt of {len(req.prompt_ids)} tokens is over this engine's "
                                  f"{self.limits.max_prompt_tokens} (--max-prompt-tokens)")
        vocab = self.runner.vocab_size
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"input_ids contain ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if (req.params.stop_strings or req.params.stop_regex_list) and self.runner.tokenizer is None:
            raise ValueError("sampling_params.stop / stop_regex need a tokenizer in the model directory; "
                             "use stop_token_ids")
        if req.return_routed_experts and req.params.max_new_tokens == 0:
            raise ValueError("return_routed_experts needs max_new_tokens >= 1 (the embedded engine runs no forward "
                             "for a request that generates nothing)")
        try:
            req.stop_patterns = [regex.compile(s) for s in req.params.stop_regex_list or ()]
        except regex.error as e:
            raise ValueError(f"sampling_params.stop_regex: {e}") from None
        if req.params.max_new_tokens == 0:
            req.finish_reason = {"type": "length", "length": 0}
            req.future.set_result(req)
            return False
        gen = None
        if req.params.sampling_seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(int(req.params.sampling_seed))
        # SGLang samples greedily below GREEDY_BELOW: z / 1e-40 overflows to inf (NaN log-probs).
        temp = req.params.temperature if req.params.temperature >= GREEDY_BELOW else 0.0
        req.sampling = RowSampling(temp, req.params.top_p, req.params.top_k, gen, req.params.min_p)
        p = req.params
        if not (p.stop_strings or p.stop_regex_list):
            req.stop_ids = frozenset(() if p.ignore_eos else self.runner.eos_token_ids) | frozenset(p.stop_token_ids or ())
            req.max_len = min(p.max_new_tokens, max_pos - len(req.prompt_ids))
        return True

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "aborted by /abort_request") -> int:
        """Mark matching requests aborted; they finish at the next step boundary."""
        return self.abort_many({rid}, abort_all, message)

    def abort_many(self, rids: set[str], abort_all: bool = False, message: str = "aborted by /abort_request") -> int:
        """``abort`` for many ids in one pass (a disconnected 10^5-sample request: one scan, not 10^5)."""
        n = 0
        with self._cv:
            for r in itertools.chain(self._waiting, self._rows):
                if (abort_all or r.rid in rids) and r.aborted is None and r.finish_reason is None:
                    r.aborted = message
                    n += 1
            self._cv.notify_all()
        if self._paused:
            # A paused loop does not step: retire aborted requests now.
            with self.model_lock:
                self._retire_aborted()
        return n

    def pause(self, mode: str = "abort") -> int:
        """Stop stepping (SGLang's three modes); returns the number of running requests touched.

        abort: in-flight requests finish now with finish_reason abort. retract: running requests
        leave the batch (their KV is dropped) and go back to the front of the queue; after
        /continue_generation they are prefilled again over prompt + tokens so far and go on
        sampling, so no sampled token is lost or repeated. in_place: they keep their cache and
        wait (then the engine is not idle and /flush_cache is refused, as in SGLang)."""
        with self._cv:
            self._paused = True
        with self.model_lock:  # returns once the step in flight has ended
            n = len(self._rows)
            if mode == "abort":
                self.abort(abort_all=True, message="aborted by /pause_generation")
                self._retire_aborted()
            elif mode == "retract" and self._rows:
                self._rb = self.runner.new_batch()
                with self._cv:
                    self._waiting.extendleft(list(self._rows))
                self.stats["retracted"] += len(self._rows)
                self._rows = []
        return n

    def is_idle(self, ignore_waiting: bool = False) -> bool:
        """SGLang's rule for /flush_cache and memory release: nothing running, and nothing
        waiting unless the engine is paused (retracted requests wait for /continue_generation)."""
        with self._cv:
            return not self._rows and (ignore_waiting or not self._waiting)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def free_idle_cache(self) -> int:
        """Drop the KV buffers when nothing is running (they are reallocated on the next admit);
        returns the bytes given back (0 while sequences run: they keep their cache)."""
        with self.model_lock:
            if self._rows:
                return 0
            freed = self._rb.nbytes
            self._rb = self.runner.new_batch()
            return freed

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (self._paused or self.runner.released or not (self._waiting or self._rows)):
                    self._cv.wait()
                if self._stop:
                    break
                admit: list[Request] = []
                free = self.max_running - len(self._rows)
                if not self._rows or free >= min(len(self._waiting), self.min_admit):
                    admit = self._waiting.take(free)
            try:
                with self.model_lock:
                    self._retire_aborted(extra=admit)
                    admit = [r for r in admit if r.finish_reason is None]
                    if admit:
                        self._prefill(admit)
                    if self._rows:
                        self._decode()
            except Exception as e:  # noqa: BLE001 - a failed step must fail its requests, not hang them
                with self._cv:
                    for r in admit + self._rows:
                        if not r.future.done():
                            r.future.set_exception(e)
                    self._rows, self._rb = [], self.runner.new_batch()

    def _prefill(self, admit: list[Request]) -> None:
        if self._rows:
            self.stats["admitted_while_running"] += len(admit)
        # A retracted request resumes from prompt + the tokens it had sampled (see pause).
        routing = any(r.return_routed_experts for r in admit)
        vision = [r.vision for r in admit] if any(r.vision is not None for r in admit) else None
        rows, logits = self.runner.prefill([r.prompt_ids + r.output_ids for r in admit], routing=routing, vision=vision)
        if routing:
            for r, ids in zip(admit, self.runner.last_routing):  # type: ignore[arg-type]
                if r.return_routed_experts:
                    r.routed = [ids]  # a retracted request's re-prefill covers what it had fed before
        self._rb.add(rows, last_tokens=self._sample_and_append(admit, logits))
        self._rows.extend(admit)
        self.stats["prefill_batches"] += 1
        self.stats["prefilled_requests"] += len(admit)
        self.stats["prefilled_unique_prompts"] += len({tuple(r.prompt_ids) for r in admit})  # see ModelRunner.prefill
        self.stats["max_batch"] = max(self.stats["max_batch"], len(self._rows))
        self._drop_finished()

    def _decode(self) -> None:
        routing = any(r.return_routed_experts for r in self._rows)
        logits = self.runner.decode(self._rb, routing=routing)
        if routing:
            step = self.runner.last_routing
            for b, r in enumerate(self._rows):
                if r.return_routed_experts:
                    r.routed.append(step[b: b + 1])  # type: ignore[index]
        self._rb.last_tokens = self._sample_and_append(self._rows, logits)
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(self._rows)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(self._rows))
        self._drop_finished()

    def _sample_and_append(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        tokens, lps = sample(logits, [r.sampling for r in reqs], self.default_gen)  # type: ignore[misc]
        want = [i for i, r in enumerate(reqs) if r.top_logprobs_num > 0]
        if want:
            vals, ids = top_logprobs(logits[want], [reqs[i].sampling.temperature for i in want],  # type: ignore[union-attr]
                                     max(reqs[i].top_logprobs_num for i in want))
            for i, v, t in zip(want, vals.tolist(), ids.tolist()):
                k = reqs[i].top_logprobs_num
                reqs[i].top_logprobs.append(list(zip(v[:k], t[:k])))
        for r, t, lp in zip(reqs, tokens.tolist(), lps.tolist()):
            r.output_ids.append(t)
            r.logprobs.append(lp)
            if r.stop_ids is None:
                r.finish_reason = self._check_finish(r, t)
            elif t in r.stop_ids:  # the rules of _check_finish without stop strings/patterns
                r.finish_reason = {"type": "stop", "matched": t}
            elif len(r.output_ids) >= r.max_len:
                r.finish_reason = {"type": "length", "length": len(r.output_ids)}
            if r.on_token is not None:
                r.on_token(r)
        return tokens

    def _check_finish(self, r: Request, t: int) -> dict[str, Any] | None:
        p = r.params
        if (not p.ignore_eos and t in self.runner.eos_token_ids) or (p.stop_token_ids and t in p.stop_token_ids):
            return {"type": "stop", "matched": t}
        stops = p.stop_strings
        if stops:
            tok = self.runner.tokenizer
            if tok is None:
                raise ValueError("sampling_params.stop needs a tokenizer in the model directory")
            window = max(len(s) for s in stops) + 8
            tail = tok.decode(r.output_ids[-window:], skip_special_tokens=p.skip_special_tokens)
            for s in stops:
                if s in tail:
                    return {"type": "stop", "matched": s}
        patterns = r.stop_patterns
        if patterns:
            tok = self.runner.tokenizer
            if tok is None:
                raise ValueError("sampling_params.stop_regex needs a tokenizer in the model directory")
            # SGLang searches a tail window of the decoded output, not all of it.
            window = max(REGEX_TAIL_TOKENS, max(len(s.pattern) for s in patterns) + 8)
            tail = tok.decode(r.output_ids[-window:], skip_special_tokens=p.skip_special_tokens)
            for s in patterns:
                try:
                    if s.search(tail, timeout=REGEX_TIMEOUT_S):
                        return {"type": "stop", "matched": s.pattern}
                except TimeoutError:
                    return {"type": "abort", "message": f"stop_regex {s.pattern!r} took over {REGEX_TIMEOUT_S} s on "
                            f"{len(tail)} characters (catastrophic backtracking); rewrite the pattern"}
        max_pos = self.runner.max_positions
        if len(r.output_ids) >= p.max_new_tokens or len(r.prompt_ids) + len(r.output_ids) >= max_pos:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.finish_reason is None]
        if len(keep) == len(self._rows):
            return
        done = [r for r in self._rows if r.finish_reason is not None]
        order = self._rb.remove([i for i, r in enumerate(self._rows) if r.finish_reason is not None])
        self._rows = [self._rows[i] for i in order]
        for r in done:
            self.stats["finished"] += 1
            r.future.set_result(r)

    def _retire_aborted(self, extra: list[Request] = ()) -> None:  # type: ignore[assignment]
        with self._cv:
            for r in list(self._waiting) + list(extra):
                if r.aborted is not None and r.finish_reason is None:
                    r.finish_reason = {"type": "abort", "message": r.aborted}
                    r.future.set_result(r)
            self._waiting.remove_if(lambda r: r.finish_reason is not None)
            for r in self._rows:
                if r.aborted is not None and r.finish_reason is None:
                    r.finish_reason = {"type": "abort", "message": r.aborted}
        self._drop_finished()
