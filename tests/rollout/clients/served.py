"""A real ``mrl engine`` HTTP server (uvicorn in a thread) over a tiny model whose tokenizer has a
chat template: what the client tests point the unmodified ``openai`` and SGLang clients at."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

from mrl.rollout.engine.server import Engine, build_app
from tests.helpers.dist import free_port
from tests.helpers.tiny_models import make_tiny_hf
from tests.helpers.tiny_tokenizer import add_chat_template


@contextlib.contextmanager
def serve(tmp: Path, token: str | None = None, max_running: int = 8) -> Iterator[tuple[str, Engine]]:
    d = make_tiny_hf(tmp / "m", "qwen2")
    add_chat_template(d)
    engine = Engine(str(d), max_running=max_running)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, token=token), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "engine server did not start in 60 s"
        time.sleep(0.05)
    try:
        yield url, engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def healthy(url: str) -> bool:
    r = httpx.post(f"{url}/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                   timeout=30, trust_env=False)
    return r.status_code == 200


def wait_until(cond, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.05)
