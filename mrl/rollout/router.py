"""Request routing over an ``EnginePool``: the built-in async router, or SGLang's router.

Built-in policy (what slime/verl users expect from sgl-router's defaults, minus the radix tree):
- least outstanding requests: a request goes to the healthy engine with the fewest in flight;
- affinity: requests sharing ``affinity_key`` go to the engine the first of them went to, so a
  shared prefix is computed once and reused from the cache (the rollout client needs none: it sends
  the n samples of a prompt as one batch request; the key serves callers that send related requests
  one by one, such as the turns of one conversation);
- per-request timeout; on a connection error, a timeout or HTTP 5xx the request is retried on
  another healthy engine (up to ``max_retries`` more attempts). A connection error takes the engine
  out at once (the pool restarts and re-syncs it) unless the engine still answers ``/health`` (a
  keep-alive connection the server closed as it was reused: counted like a 5xx); 5xx and timeouts
  count towards ``max_failures``. HTTP 4xx is the caller's error and is not retried.

With ``rollout.router: sglang_router`` the driver launches SGLang's router in front of the engines
(``mrl.rollout.sglang_router.SGLangRouter``) and this ``Router`` sends to it as its only upstream
(control calls still go to each engine directly).
"""
from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from mrl.rollout.http import RequestTimeout, TransportError
from mrl.rollout.pool import EngineEndpoint, EnginePool


class NoHealthyEngineError(RuntimeError):
    pass


@dataclass
class RouteOutcome:
    """The engine's JSON (None when every attempt failed), where it ran, and why it failed."""

    body: Any
    engine_url: str | None
    attempts: int
    error: str | None = None


class Router:
    def __init__(
        self,
        pool: EnginePool,
        *,
        max_retries: int = 3,
        request_timeout_s: float = 600.0,
        no_engine_wait_s: float = 120.0,
    ) -> None:
        self.pool = pool
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.no_engine_wait_s = no_engine_wait_s
        self._affinity: dict[Hashable, EngineEndpoint] = {}

    def pick(self, affinity_key: Hashable | None = None, exclude: Sequence[EngineEndpoint] = ()) -> EngineEndpoint | None:
        """Sticky engine for ``affinity_key`` if still healthy, else least outstanding (ties: the
        one that served fewest, so an idle pool spreads prompts round-robin)."""
        if affinity_key is not None:
            e = self._affinity.get(affinity_key)
            if e is not None and e.healthy and e not in exclude:
                return e
        cands = [e for e in self.pool.engines if e.healthy and e not in exclude]
        if not cands:
            return None
        e = min(cands, key=lambda x: (x.outstanding, x.served))
        if affinity_key is not None:
            self._affinity[affinity_key] = e
        return e

    def forget(self, affinity_key: Hashable) -> None:
        self._affinity.pop(affinity_key, None)

    async def _pick_or_wait(self, key: Hashable | None, exclude: list[EngineEndpoint]) -> EngineEndpoint:
        deadline = time.monotonic() + self.no_engine_wait_s
        while True:
            e = self.pick(key, exclude)
            if e is None and exclude:
                # every other engine was tried: allow a healthy one again rather than fail.
                e = self.pick(key, ())
            if e is not None:
                return e
            if time.monotonic() > deadline:
                raise NoHealthyEngineError(
                    f"no healthy engine for {self.no_engine_wait_s:.0f}s; last errors: "
                    + "; ".join(f"{x.url}: {x.last_error}" for x in self.pool.engines)
                )
            await asyncio.sleep(0.2)

    async def generate(
        self, payload: dict[str, Any], affinity_key: Hashable | None = None, timeout_s: float | None = None
    ) -> RouteOutcome:
        """POST /generate with retries; never raises for engine failures (returns the reason)."""
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        tried: list[EngineEndpoint] = []
        errors: list[str] = []
        for attempt in range(1, self.max_retries + 2):
            try:
                e = await self._pick_or_wait(affinity_key, tried)
            except NoHealthyEngineError as ex:
                errors.append(str(ex))
                return RouteOutcome(None, None, attempt - 1, " | ".join(errors))
            e.outstanding += 1
            try:
                r = await self.pool.client().post(e.url + "/generate", json=payload, timeout=timeout_s)
            except RequestTimeout:
                errors.append(f"{e.url}: timeout after {timeout_s}s")
                self._count_failure(e, errors[-1])
            except TransportError as ex:
                errors.append(f"{e.url}: connection error {ex}")
                await self._connection_failed(e, errors[-1])
            else:
                if r.status_code < 300:
                    e.served += 1
                    e.failures = 0
                    try:
                        return RouteOutcome(r.json(), e.url, attempt)
                    except ValueError:
                        return RouteOutcome(None, e.url, attempt, f"{e.url}: /generate answered HTTP {r.status_code} "
                                            f"with a body that is not JSON: {r.text[:300]!r}")
                errors.append(f"{e.url}: HTTP {r.status_code}: {r.text[:300]}")
                if r.status_code < 500:
                    return RouteOutcome(None, e.url, attempt, errors[-1])
                self._count_failure(e, errors[-1])
            finally:
                e.outstanding -= 1
            tried.append(e)
            if affinity_key is not None:
                self.forget(affinity_key)
        return RouteOutcome(None, None, self.max_retries + 1, " | ".join(errors))

    async def _connection_failed(self, e: EngineEndpoint, reason: str) -> None:
        """Out at once if the engine is gone; a failure like a 5xx if it still answers /health."""
        try:
            alive = (await self.pool.client().get(e.url + "/health", timeout=5.0)).status_code == 200
        except TransportError:
            alive = False
        if alive:
            self._count_failure(e, reason + " (the engine answers /health)")
        else:
            self.pool.mark_unhealthy(e, reason)

    def _count_failure(self, e: EngineEndpoint, reason: str) -> None:
        e.failures += 1
        e.last_error = reason
        if e.failures >= self.pool.max_failures:
            self.pool.mark_unhealthy(e, f"{e.failures} consecutive failures, last: {reason}")


def sglang_router_available() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def build_sglang_router_command(
    worker_urls: Sequence[str], port: int, host: str = "127.0.0.1", policy: str = "cache_aware",
    python: str = sys.executable,
) -> list[str]:
    """argv of ``python -m sglang_router.launch_router`` in front of already-running engines."""
    return [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
            "--host", host, "--port", str(port), "--policy", policy]


def make_router(pool: EnginePool, kind: str = "builtin", **kw: Any) -> Router:
    """``kind``: ``builtin``, or ``sglang_router``: the caller has started SGLang's router
    (``mrl.rollout.sglang_router.SGLangRouter``, which needs the package) and passes a pool whose
    single engine is the router's url."""
    if kind not in ("builtin", "sglang_router"):
        raise ValueError(f"rollout.router must be 'builtin' or 'sglang_router', got {kind!r}")
    return Router(pool, **kw)
