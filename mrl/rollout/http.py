"""The rollout client's HTTP plumbing: one aiohttp session and one background asyncio loop.

aiohttp, not httpx: httpx's connection pool scans every queued request against every connection
on each request start and end, which made the client, not the engines, the bottleneck of a rollout
(docs/performance.md, 'aiohttp, not httpx').
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")


class TransportError(RuntimeError):
    """No HTTP answer: connection refused/reset, or the server closed the connection mid-request."""


class RequestTimeout(TransportError):
    """No answer within the request's timeout."""


@dataclass
class Answer:
    """An HTTP answer, read whole."""

    status_code: int
    content: bytes
    content_type: str

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class PoolHTTP:
    """The pool's aiohttp session (created on first use, on the pool's loop)."""

    # Idle connections expire after 2 s, below the server's 5 s keep-alive (uvicorn's default, SGLang's
    # too): with equal timers a connection idle ~5 s between steps can be reused just as the server
    # closes it, a connection error that would take a healthy engine out.
    KEEPALIVE_S = 2.0
    MAX_CONNECTIONS = 1024  # requests beyond this wait in the client (file descriptors are finite)

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            conn = aiohttp.TCPConnector(limit=self.MAX_CONNECTIONS, keepalive_timeout=self.KEEPALIVE_S)
            # trust_env=False: engines are addressed directly, never through an HTTP proxy.
            self._session = aiohttp.ClientSession(connector=conn, headers=self.headers, trust_env=False)
        return self._session

    async def request(self, method: str, url: str, *, json: Any = None, timeout: float | None = None) -> Answer:
        """One call; raises :class:`RequestTimeout` or :class:`TransportError` when no answer came."""
        try:
            async with self.session().request(method, url, json=json,
                                              timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return Answer(r.status, await r.read(), r.headers.get("content-type", ""))
        except TimeoutError as ex:
            raise RequestTimeout(f"no answer within {timeout}s") from ex
        except aiohttp.ClientError as ex:
            raise TransportError(f"{type(ex).__name__}: {ex}") from ex

    async def get(self, url: str, *, timeout: float | None = None) -> Answer:
        return await self.request("GET", url, timeout=timeout)

    async def post(self, url: str, *, json: Any = None, timeout: float | None = None) -> Answer:
        return await self.request("POST", url, json=json, timeout=timeout)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class PoolLoop:
    """An asyncio loop in a daemon thread; ``run(coro)`` blocks the caller until it finishes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mrl-rollout-pool", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
