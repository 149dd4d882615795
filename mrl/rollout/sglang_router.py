"""SGLang's router (``sglang_router``, a Rust load balancer) in front of already-running engines.

``rollout.router: sglang_router`` starts it in a child process (``python -m
sglang_router.launch_router --worker-urls ... --policy cache_aware``); the rollout client then sends
every ``/generate`` to the router, and the router picks the engine (cache-aware: requests sharing a
prefix go to the engine that has it). Control calls (pause, flush, weight updates, memory release)
still go to each engine directly, through the engine pool.

The engine pool stays in charge of engine health: when it takes an engine out (to restart and
re-sync it) the engine is removed from the router, and added back only once it serves the current
weights, so the router never sends a request to an engine with stale weights. The router's worker
API changed across releases: ``GET/POST /workers`` and ``DELETE /workers/{id}`` (0.3), else the
older ``/add_worker?url=`` / ``/remove_worker?url=``; both are tried.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from mrl.rollout.router import build_sglang_router_command, sglang_router_available
from mrl.rollout.sglang_launcher import EngineProcess

log = logging.getLogger(__name__)


class SGLangRouter:
    """One ``sglang_router`` process: start (waits for /health), worker add/remove, stop, restart."""

    def __init__(self, worker_urls: Sequence[str], port: int, log_path: str | os.PathLike, *,
                 host: str = "127.0.0.1", policy: str = "cache_aware", startup_timeout_s: float = 120.0,
                 env: dict[str, str] | None = None, python: str = sys.executable) -> None:
        if not sglang_router_available():
            raise RuntimeError("rollout.router=sglang_router needs the sglang_router package "
                               "(pip install sglang-router); or set rollout.router=builtin")
        cmd = build_sglang_router_command(list(worker_urls), port, host=host, policy=policy, python=python)
        self.url = f"http://{host}:{port}"
        self.proc = EngineProcess(cmd, self.url, Path(log_path), env=env, startup_timeout_s=startup_timeout_s)

    def start(self) -> None:
        self.proc.start()

    def restart(self) -> None:
        """The routing pool's restart callback. The router is started with the initial worker list;
        engines out of service at that moment are removed again by the engine pool's next change."""
        self.proc.restart()

    def stop(self) -> None:
        self.proc.stop()

    def workers(self) -> list[dict] | None:
        """The router's workers (``GET /workers``: url, id, is_healthy, ...); None before 0.3 (no such API)."""
        r = httpx.get(self.url + "/workers", timeout=30, trust_env=False)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()["workers"]

    def remove_worker(self, url: str) -> None:
        url = url.rstrip("/")
        workers = self.workers()
        if workers is None:  # sglang_router < 0.3
            r = httpx.post(self.url + "/remove_worker", params={"url": url}, timeout=30, trust_env=False)
        else:
            ids = [w["id"] for w in workers if w["url"].rstrip("/") == url]
            if not ids:
                return  # not routed to (already removed)
            r = httpx.delete(f"{self.url}/workers/{ids[0]}", timeout=30, trust_env=False)
        if r.status_code >= 300:
            raise RuntimeError(f"sglang_router {self.url}: removing worker {url} answered HTTP {r.status_code}: "
                               f"{r.text[:300]}")

    def add_worker(self, url: str) -> None:
        url = url.rstrip("/")
        r = httpx.post(self.url + "/workers", json={"url": url}, timeout=60, trust_env=False)
        if r.status_code in (404, 405):  # sglang_router < 0.3
            r = httpx.post(self.url + "/add_worker", params={"url": url}, timeout=60, trust_env=False)
        if r.status_code >= 300:
            raise RuntimeError(f"sglang_router {self.url}: adding worker {url} answered HTTP {r.status_code}: "
                               f"{r.text[:300]}")

    def on_engine_service(self, url: str, serving: bool) -> None:
        """The engine pool's hook: an engine left service (restart pending) or came back synced."""
        log.warning("sglang_router: %s engine %s", "adding" if serving else "removing", url)
        (self.add_worker if serving else self.remove_worker)(url)
