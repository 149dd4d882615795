"""Router and client against engines that misbehave at the HTTP level (a raw asyncio server plays
the engine: no model needed): a connection the server drops while it still answers /health, and
a batch answer of the wrong length."""
from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from mrl.rollout.client import RolloutClient
from mrl.rollout.pool import EngineEndpoint, EnginePool
from mrl.rollout.router import Router
from mrl.rollout.types import RolloutRequest


class FaultyEngine:
    """Answers GET /health with 200; POST /generate per ``mode``: ``drop`` closes the connection
    without answering, ``short`` answers a batch with one result too few, ``ok`` answers it whole;
    ``sick`` answers /health_generate with HTTP 500."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.generate_calls = 0
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *headers = head.decode().split("\r\n")
                size = next((int(h.split(":")[1]) for h in headers if h.lower().startswith("content-length")), 0)
                body = json.loads(await reader.readexactly(size)) if size else None
                if line.startswith("GET /health_generate") and self.mode == "sick":
                    self._answer(writer, 500, b"scheduler stuck")
                elif line.startswith("GET /health"):
                    self._answer(writer, 200, b"")
                elif line.startswith("POST /generate"):
                    self.generate_calls += 1
                    if self.mode == "drop":
                        writer.close()
                        return
                    n = len(body["input_ids"]) - (1 if self.mode == "short" else 0)
                    one = {"text": "", "output_ids": [7], "meta_info": {
                        "finish_reason": {"type": "length", "length": 1}, "weight_version": "default",
                        "output_token_logprobs": [[-0.5, 7, None]]}}
                    self._answer(writer, 200, json.dumps([one] * n).encode(), "application/json")
                else:
                    self._answer(writer, 404, b"")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    @staticmethod
    def _answer(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str = "text/plain") -> None:
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                     + body)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def engines():
    made: list[FaultyEngine] = []
    yield lambda mode: made.append(FaultyEngine(mode)) or made[-1]
    for e in made:
        e.close()


def test_dropped_connection_on_a_live_engine_is_retried_without_taking_it_out(engines):
    drop, ok = engines("drop"), engines("ok")
    pool = EnginePool([EngineEndpoint(drop.url), EngineEndpoint(ok.url)], health_interval_s=0, max_failures=3)
    try:
        res = RolloutClient(Router(pool, max_retries=2)).generate(
            RolloutRequest([[1, 2], [3, 4]], n=3, sampling_params={"max_new_tokens": 1}))
    finally:
        pool.close()
    assert not res.failed and len(res.samples) == 6
    assert {s.engine_url for s in res.samples} == {ok.url}
    assert drop.generate_calls >= 1
    flaky = pool.engines[0]
    # still in service: it answered /health, so the drop counted as one failure, not a crash
    assert flaky.healthy and flaky.failures == drop.generate_calls and "answers /health" in flaky.last_error
    assert any(s.attempts == 2 for s in res.samples)


def test_batch_answer_of_the_wrong_length_fails_every_sample_of_the_prompt(engines):
    short = engines("short")
    pool = EnginePool([EngineEndpoint(short.url)], health_interval_s=0)
    try:
        res = RolloutClient(Router(pool)).generate(RolloutRequest([[1, 2]], n=4, sampling_params={"max_new_tokens": 1}))
    finally:
        pool.close()
    assert len(res.samples) == 4 and len(res.failed) == 4
    assert all("batch of 4 answered a list of 3, not a list of 4" in s.error for s in res.samples)


def test_health_probe_errors_count_towards_max_failures_before_a_restart(engines):
    sick = engines("sick")
    restarts = []
    # The restart runs in the background as soon as the engine is taken out; it waits for this gate,
    # so the engine cannot be back in service before the assertions below (on a loaded host it was).
    gate = threading.Event()

    def restart() -> None:
        assert gate.wait(30), "test never opened the restart gate"
        restarts.append(1)

    pool = EnginePool([EngineEndpoint(sick.url, restart=restart)], health_interval_s=0,
                      max_failures=3, restart_timeout_s=5)
    try:
        e = pool.engines[0]
        for k in (1, 2):
            assert pool.loop.run(pool.check_health()) == {sick.url: False}
            assert e.healthy and e.failures == k and "HTTP 500" in e.last_error and not restarts
        e.outstanding = 1  # an engine answering requests is not probed
        assert pool.loop.run(pool.check_health()) == {} and e.failures == 2
        e.outstanding = 0
        assert pool.loop.run(pool.check_health()) == {sick.url: False}
        assert not e.healthy and "3 consecutive failures" in e.last_error and not restarts
        gate.set()
        pool.wait_recovered(30)
        assert restarts == [1] and e.healthy and e.failures == 0
    finally:
        gate.set()
        pool.close()


def test_the_pre_push_probe_takes_out_a_dead_engine_and_names_one_that_cannot_come_back(engines):
    """probe_alive (before every weight push): no connection -> taken out and restarted; an answer -> alive.
    A restart that fails leaves the engine in lost_engines with the reason."""
    ok = engines("ok")
    with socket.socket() as s:  # a port nothing listens on: what a SIGKILLed server leaves
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"

    def cannot_restart() -> None:
        raise RuntimeError("restart of engine 1 failed: no config.json")

    pool = EnginePool([EngineEndpoint(ok.url), EngineEndpoint(dead_url, cannot_restart)],
                      health_interval_s=0, restart_timeout_s=5)
    try:
        gone = pool.loop.run(pool.probe_alive())
        assert [e.url for e in gone] == [dead_url]
        pool.wait_recovered(30)
        assert [(i, e.url) for i, e in pool.lost_engines()] == [(1, dead_url)]
        assert "recovery failed: RuntimeError: restart of engine 1 failed" in pool.engines[1].last_error
        assert pool.engines[0].healthy and pool.lost_engines() == [(1, pool.engines[1])]
    finally:
        pool.close()
