"""N engines behind one client: health, control fan-out, take-out / restart / re-sync.

Every engine speaks SGLang's HTTP protocol. The pool owns the engines' *state* (healthy,
outstanding requests, failures), not their processes: whoever owns a process hands in a
``restart`` callback (``EngineProcess.restart`` or a Ray actor call). The weight-sync side hands
in ``resync(url)``, which pushes the current weights to one engine; the pool then checks that the
engine reports the current ``weight_version`` before routing to it again.

All network work runs on one asyncio loop in a background thread (``PoolLoop``), so periodic
``/health_generate`` checks go on between batches and the sync API is usable from the driver.

HTTP (one aiohttp session) and the loop live in :mod:`mrl.rollout.http`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mrl.rollout.http import PoolHTTP, PoolLoop, RequestTimeout, TransportError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class EngineEndpoint:
    """One engine. ``restart`` is blocking and brings the engine back at the same url."""

    url: str
    restart: Callable[[], None] | None = None
    healthy: bool = True
    recovering: bool = False
    awaiting_sync: bool = False  # restarted with no resync callback: back after the next weight sync
    outstanding: int = 0
    failures: int = 0
    restarts: int = 0
    last_error: str | None = None
    served: int = field(default=0)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")


class EnginePool:
    """Engines + their health. ``token`` goes into ``Authorization: Bearer`` for control calls
    (every engine mrl starts requires it on its control routes, as SGLang does with ``--admin-api-key``)."""

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        *,
        token: str | None = None,
        health_interval_s: float = 10.0,
        health_timeout_s: float = 30.0,
        restart_timeout_s: float = 600.0,
        max_failures: int = 3,
    ) -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine; set rollout.num_engines >= 1")
        self.engines = list(engines)
        self.token = token
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.max_failures = max_failures
        #: the version the last weight sync pushed (None: engines still hold their start weights)
        self.weight_version: str | None = None
        self.resync: Callable[[str], None] | None = None
        #: called (blocking, off the loop) with (url, False) when an engine is taken out for a restart
        #: and (url, True) once it serves the current weights again: keeps an external router in step
        self.on_service_change: Callable[[str, bool], None] | None = None
        #: engines released their memory (release_memory): health probes pause until resume_memory
        self.asleep = False
        self.loop = PoolLoop()
        self._http = PoolHTTP(self.headers)
        self._health_task: asyncio.Future | None = None
        self._recoveries: dict[str, asyncio.Future] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self) -> PoolHTTP:
        """The pool's HTTP client (use it on the pool's loop)."""
        return self._http

    def start_health_checks(self) -> None:
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.run_coroutine_threadsafe(self._health_loop(), self.loop.loop)

    def close(self) -> None:
        async def _close() -> None:
            await self._http.close()
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        self.loop.run(_close())
        self.loop.close()

    # ---- health ----------------------------------------------------------------------------
    def healthy_engines(self) -> list[EngineEndpoint]:
        return [e for e in self.engines if e.healthy]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_health()
            except Exception:
                log.exception("health check round failed")

    async def check_health(self) -> dict[str, bool]:
        """GET /health_generate (a 1-token generation) on every healthy engine with no request in
        flight (one that is answering requests shows it is alive, and a probe queued behind its batch
        could time out). No connection: the engine is taken out and its recovery starts. A timeout or
        an error status counts towards ``max_failures`` in a row, as for requests."""
        async def one(e: EngineEndpoint) -> bool:
            gone = False
            try:
                r = await self.client().get(e.url + "/health_generate", timeout=self.health_timeout_s)
                if r.status_code == 200:
                    e.failures = 0
                    return True
                reason = f"/health_generate answered HTTP {r.status_code}"
            except RequestTimeout:
                reason = f"/health_generate: no answer within {self.health_timeout_s}s"
            except TransportError as ex:
                gone, reason = True, f"/health_generate failed: {ex}"
            if self.asleep:  # a probe that raced release_memory is not a failure
                return False
            if gone:
                self.mark_unhealthy(e, reason)
            else:
                e.failures, e.last_error = e.failures + 1, reason
                if e.failures >= self.max_failures:
                    self.mark_unhealthy(e, f"{e.failures} consecutive failures, last: {reason}")
            return False
        if self.asleep:
            return {}
        idle = [e for e in self.healthy_engines() if e.outstanding == 0]
        oks = await asyncio.gather(*(one(e) for e in idle))
        return {e.url: ok for e, ok in zip(idle, oks)}

    async def probe_alive(self, timeout_s: float = 5.0) -> list[EngineEndpoint]:
        """GET /health on every engine in service; one that no connection reaches (a killed server) is
        taken out and its recovery starts. Any HTTP answer, or none within ``timeout_s``, counts as alive
        (SGLang's /health may run a 1-token generation: a busy or sleeping engine answers late or 503).
        Before a weight push: the senders would otherwise meet the dead engine mid-push. Returns the
        engines taken out."""
        async def one(e: EngineEndpoint) -> bool:
            try:
                await self.client().get(e.url + "/health", timeout=timeout_s)
                return True
            except RequestTimeout:
                return True  # busy, not gone: the request path and /health_generate judge it
            except TransportError as ex:
                self.mark_unhealthy(e, f"/health before a weight push: {ex}")
                return False
        live = self.healthy_engines()
        alive = await asyncio.gather(*(one(e) for e in live))
        return [e for e, ok in zip(live, alive) if not ok]

    def take_out_dead(self) -> list[EngineEndpoint]:
        """:meth:`probe_alive` from a caller outside the pool's loop (the driver)."""
        return self.loop.run(self.probe_alive())

    def lost_engines(self) -> list[tuple[int, EngineEndpoint]]:
        """(index, engine) of engines out of service with no recovery under way and none to come: the
        restart failed, or there is no restart (an engine that lives in a trainer rank)."""
        return [(i, e) for i, e in enumerate(self.engines)
                if not e.healthy and not e.recovering and not e.awaiting_sync and e.url not in self._recoveries]

    def mark_unhealthy(self, e: EngineEndpoint, reason: str) -> None:
        """Take ``e`` out of routing and (once) start restart + re-sync in the background."""
        e.last_error = reason
        if e.healthy:
            log.warning("engine %s taken out: %s", e.url, reason)
        e.healthy = False
        if e.url not in self._recoveries and e.restart is not None:
            self._recoveries[e.url] = asyncio.run_coroutine_threadsafe(self._recover(e), self.loop.loop)

    async def _service_changed(self, e: EngineEndpoint, serving: bool) -> None:
        if self.on_service_change is not None:
            try:
                await asyncio.to_thread(self.on_service_change, e.url, serving)
            except Exception as ex:  # noqa: BLE001 - the engine's own recovery goes on; logged
                log.error("engine %s: service-change hook (%s) failed: %s", e.url, serving, ex)

    async def _recover(self, e: EngineEndpoint) -> None:
        e.recovering = True
        await self._service_changed(e, False)
        try:
            # restart/resync block (process launch, weight push): keep them off the event loop.
            await asyncio.to_thread(e.restart)
            await self._wait_health(e)
            if self.weight_version is not None:
                if self.resync is None:
                    # Alive but on its start weights: out of routing until the trainer's next weight
                    # sync reaches it (``readmit``), which is the driver's job between steps.
                    e.awaiting_sync = True
                    log.warning("engine %s restarted; it serves again after the next weight sync", e.url)
                    return
                await asyncio.to_thread(self.resync, e.url)
                got = await self.get_weight_version(e)
                if got != self.weight_version:
                    raise RuntimeError(
                        f"engine {e.url} reports weight_version {got!r} after re-sync, expected {self.weight_version!r}"
                    )
            e.restarts += 1
            e.failures = 0
            await self._service_changed(e, True)
            e.healthy = True
            log.warning("engine %s back in service (restart #%d)", e.url, e.restarts)
        except Exception as ex:  # noqa: BLE001 - stays out of service, reason recorded
            e.last_error = f"recovery failed: {type(ex).__name__}: {ex}"
            log.error("engine %s recovery failed: %s", e.url, ex)
        finally:
            e.recovering = False
            self._recoveries.pop(e.url, None)

    async def _wait_health(self, e: EngineEndpoint) -> None:
        # The restart callback's own wait (EngineProcess.wait_healthy) runs where the process runs,
        # possibly another node; this poll is the pool's view over its own session, which is the
        # one that routes requests.
        deadline = time.monotonic() + self.restart_timeout_s
        while True:
            try:
                r = await self.client().get(e.url + "/health", timeout=5.0)
                if r.status_code == 200:
                    return
            except TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {e.url} not healthy {self.restart_timeout_s}s after restart")
            await asyncio.sleep(0.3)

    def readmit(self, version: str) -> list[str]:
        """Engines that waited for a weight sync (``awaiting_sync``) and now report ``version`` serve
        again; returns their urls. One reporting another version is an error naming it."""
        back = []
        for e in [e for e in self.engines if e.awaiting_sync]:
            got = self.loop.run(self.get_weight_version(e))
            if got != version:
                raise RuntimeError(f"engine {e.url} restarted and was synced, but reports weight_version {got!r}, "
                                   f"expected {version!r}")
            self.loop.run(self._service_changed(e, True))
            e.awaiting_sync, e.healthy, e.failures = False, True, 0
            e.restarts += 1
            back.append(e.url)
            log.warning("engine %s back in service at weight version %s (restart #%d)", e.url, version, e.restarts)
        return back

    def wait_recovered(self, timeout_s: float = 120.0) -> None:
        """Block until no recovery is in flight (tests and orderly shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._recoveries:
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine recovery still running after {timeout_s}s: {list(self._recoveries)}")
            time.sleep(0.2)

    # ---- control fan-out -------------------------------------------------------------------
    async def get_weight_version(self, e: EngineEndpoint) -> str | None:
        """SGLang serves ``GET /get_weight_version``; older servers only ``/get_model_info``."""
        for path in ("/get_weight_version", "/get_model_info"):
            r = await self.client().get(e.url + path, timeout=30.0)
            if r.status_code == 200 and "weight_version" in r.json():
                v = r.json()["weight_version"]
                return None if v is None else str(v)
        raise RuntimeError(f"engine {e.url} reports no weight_version on /get_weight_version or /get_model_info")

    async def acontrol(
        self, path: str, payload: dict[str, Any] | None = None, *, method: str = "POST",
        engines: Sequence[EngineEndpoint] | None = None, timeout_s: float = 600.0,
    ) -> dict[str, Any]:
        """Call ``path`` on the engines (default: all healthy ones) concurrently; any non-2xx or a
        body with ``success: false`` raises, naming the engine and the endpoint."""
        targets = self.healthy_engines() if engines is None else list(engines)

        async def one(e: EngineEndpoint) -> Any:
            r = await self.client().request(method, e.url + path, json=payload, timeout=timeout_s)
            if r.status_code >= 300:
                raise RuntimeError(f"{method} {e.url}{path} -> HTTP {r.status_code}: {r.text[:500]}")
            # SGLang answers some control calls with plain text (/flush_cache: "Cache flushed.").
            json_body = r.content_type.startswith("application/json")
            body = r.json() if r.content and json_body else {}
            if isinstance(body, dict) and body.get("success") is False:
                raise RuntimeError(f"{method} {e.url}{path} failed: {body.get('message')}")
            return body
        outs = await asyncio.gather(*(one(e) for e in targets))
        return {e.url: o for e, o in zip(targets, outs)}

    def control(self, path: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return self.loop.run(self.acontrol(path, payload, **kw))

    def pause(self, engines: Sequence[EngineEndpoint] | None = None, mode: str = "retract") -> None:
        """SGLang's pause; "retract" keeps in-flight samples (they resume after :meth:`resume`)."""
        self.control("/pause_generation", {"mode": mode}, engines=engines)

    def flush(self, engines: Sequence[EngineEndpoint] | None = None) -> None:
        self.control("/flush_cache", None, engines=engines)

    def resume(self, engines: Sequence[EngineEndpoint] | None = None) -> None:
        self.control("/continue_generation", {}, engines=engines)

    def release_memory(self) -> None:
        """Put every engine to sleep (SGLang's /release_memory_occupation: KV cache and weights) so a
        colocated trainer gets the device memory; no health probes until :meth:`resume_memory`,
        since a sleeping engine cannot generate."""
        self.asleep = True
        self.control("/release_memory_occupation", {})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Wake the engines: ``tags`` ``["weights"]`` first (then sync them), ``["kv_cache"]`` after, as
        verl does to keep the peak low; None restores everything. Probing resumes with the KV cache."""
        self.control("/resume_memory_occupation", {"tags": list(tags)} if tags else {})
        if tags is None or "kv_cache" in tags:
            self.asleep = False

    def engine(self, url: str) -> EngineEndpoint:
        for e in self.engines:
            if e.url == url.rstrip("/"):
                return e
        raise KeyError(f"no engine with url {url!r} in the pool; engines: {[e.url for e in self.engines]}")
