"""OpenAI-compatible client of the judge's servers: the judge engines mrl starts (the embedded
engine's and SGLang's /v1 routes) or an external ``reward.judge.url``.

    completions: POST {url}/v1/completions       {"prompt": [p_1 .. p_k], "max_tokens", "temperature", ...}
    chat:        POST {url}/v1/chat/completions  {"messages": [{"role": "user", "content": p}], ...}

Requests go round-robin over the servers, at most ``max_concurrency`` in flight. A request that fails
to connect, times out (``timeout_s``) or gets a 5xx/429 is retried up to ``max_retries`` times (0.2 s,
0.4 s, ... apart); then each of its prompts gets an error string instead of an answer, which the
caller counts and hands to reward.on_error. So one call takes at most about
``ceil(requests / max_concurrency) * (max_retries + 1) * timeout_s`` seconds. A 401/403 is a wrong or
missing token, not a fault of one sample: :class:`JudgeHTTPError` stops the run with the fix.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

RETRY_STATUS = {429, 500, 502, 503, 504}


class JudgeHTTPError(RuntimeError):
    """The judge server refused the credentials (or the request shape) for every sample."""


class JudgeClient:
    """Batched, concurrent verdict generation (module doc). ``token``: bearer token or None."""

    def __init__(self, urls: Sequence[str], *, api: str = "completions", token: str | None = None,
                 token_source: str = "", model: str = "default", max_new_tokens: int = 16, temperature: float = 0.0,
                 timeout_s: float = 60.0, max_retries: int = 2, max_concurrency: int = 8, batch_size: int = 32,
                 seed: int | None = 0) -> None:
        if not urls:
            raise ValueError("the judge client needs at least one server url")
        self.urls = [u.rstrip("/") for u in urls]
        self.api, self.model, self.token_source = api, model, token_source
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self.batch_size = batch_size if api == "completions" else 1
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # trust_env=False: a proxy from the environment must not see the token or the samples
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers, trust_env=False,
                                  limits=httpx.Limits(max_connections=max_concurrency))
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="mrl-judge")
        self._next = itertools.count()

    def _body(self, prompts: list[str]) -> tuple[str, dict[str, Any]]:
        common: dict[str, Any] = {"model": self.model, "max_tokens": self.max_new_tokens, "temperature": self.temperature}
        if self.seed is not None:
            common["seed"] = self.seed
        if self.api == "chat":
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompts[0]}]}
        return "/v1/completions", {**common, "prompt": prompts}

    def _answers(self, path: str, data: dict[str, Any], n: int) -> list[str]:
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            raise ValueError(f"{path} answered {len(choices) if isinstance(choices, list) else 'no'} choices for {n} prompts")
        out: list[str] = [""] * n
        for k, c in enumerate(choices):
            i = c.get("index", k)
            text = c["message"]["content"] if self.api == "chat" else c["text"]
            out[i] = text if isinstance(text, str) else ""
        return out

    def _request(self, prompts: list[str]) -> list[str | Exception]:
        url = self.urls[next(self._next) % len(self.urls)]
        path, body = self._body(prompts)
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(0.2 * 2 ** (attempt - 1))
            try:
                r = self._http.post(url + path, json=body)
            except httpx.TimeoutException:
                last = TimeoutError(f"judge request to {url}{path} took more than reward.judge.timeout_s={self.timeout_s}s")
                continue
            except httpx.HTTPError as e:
                last = ConnectionError(f"judge request to {url}{path} failed: {type(e).__name__}: {e}")
                continue
            if r.status_code in (401, 403):
                raise JudgeHTTPError(
                    f"the judge server {url} refused the request with HTTP {r.status_code} ({r.text[:200]!r}): a wrong or "
                    f"missing token; fix: {self.token_source or 'the token'} must hold the server's API key (reward.judge.url="
                    f"{url}, reward.judge.token_env)")
            if r.status_code in RETRY_STATUS:
                last = ConnectionError(f"judge server {url}{path} answered HTTP {r.status_code}: {r.text[:200]}")
                continue
            if r.status_code != 200:  # a request the server refuses will be refused again
                err = ValueError(f"judge server {url}{path} answered HTTP {r.status_code}: {r.text[:300]}")
                return [err] * len(prompts)
            try:
                return list(self._answers(path, r.json(), len(prompts)))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                return [ValueError(f"judge server {url}{path}: unexpected answer ({e})")] * len(prompts)
        assert last is not None
        return [last] * len(prompts)

    def generate(self, prompts: Sequence[str]) -> list[str | Exception]:
        """One answer per prompt, in order: the verdict text, or the exception that kept it from coming."""
        chunks = [list(prompts[i:i + self.batch_size]) for i in range(0, len(prompts), self.batch_size)]
        out: list[str | Exception] = []
        for part in self._pool.map(self._request, chunks):
            out += part
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
