"""Wait for a server subprocess the tests started to answer (or fail with its exit code)."""
from __future__ import annotations

import subprocess
import time

import httpx


def wait_http_ok(url: str, proc: subprocess.Popen, path: str = "/health", timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"server for {url} exited with code {proc.returncode}"
        try:
            if httpx.get(url + path, timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url}{path} did not answer 200 within {timeout_s:.0f} s"
        time.sleep(0.5)
