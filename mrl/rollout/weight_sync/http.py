"""Blocking HTTP calls from a trainer rank to engines (control plane of the weight sync).

Trainer ranks are plain processes (no event loop), and the ``distributed`` transport needs the
engine call in flight *while* the rank broadcasts, so calls run in a small thread pool.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx


class EngineCallError(RuntimeError):
    """A control call failed; ``status`` is the HTTP status (None: the engine said success=false)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineHttp:
    def __init__(self, urls: Sequence[str], token: str | None = None, timeout_s: float = 600.0) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(timeout=timeout_s, headers=headers, trust_env=False)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.urls)), thread_name_prefix="mrl-wsync-http")

    def call(self, url: str, path: str, payload: dict[str, Any] | None = None, method: str = "POST") -> dict[str, Any]:
        """One call; non-2xx or ``success: false`` raises naming the engine and endpoint."""
        r = self._client.request(method, url + path, json=payload)
        if r.status_code >= 300:
            raise EngineCallError(f"{method} {url}{path} -> HTTP {r.status_code}: {r.text[:800]}", r.status_code)
        # SGLang answers some control calls with plain text (/flush_cache: "Cache flushed.").
        json_body = r.headers.get("content-type", "").startswith("application/json")
        body = r.json() if r.content and json_body else {}
        if isinstance(body, dict) and body.get("success") is False:
            raise EngineCallError(f"{method} {url}{path} failed: {body.get('message')}")
        return body

    def submit_all(self, path: str, payload: dict[str, Any] | None = None, urls: Sequence[str] | None = None,
                   method: str = "POST") -> list[Future]:
        return [self._pool.submit(self.call, u, path, payload, method) for u in (urls or self.urls)]

    def call_all(self, path: str, payload: dict[str, Any] | None = None, urls: Sequence[str] | None = None,
                 method: str = "POST") -> list[dict[str, Any]]:
        return wait_all(self.submit_all(path, payload, urls, method))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def wait_all(futures: Sequence[Future]) -> list[Any]:
    """Results in order; the first failure is raised after every call has ended (no call is
    left running against an engine we are about to talk to again)."""
    out, err = [], None
    for f in futures:
        try:
            out.append(f.result())
        except BaseException as e:  # noqa: BLE001
            err = err or e
    if err is not None:
        raise err
    return out
