"""The launcher side of an engine over several nodes, run for real on Ray (the session's shared instance): one
launcher actor per node owns that node's server; ``RemoteEngine`` starts them together, waits for every node,
restarts all of them when the engine restarts and stops all of them. SGLang cannot run on these CPU hosts: each
node's server is a stand-in HTTP server answering /health (as SGLang's node-rank 0 API and its other nodes'
health server do), node-rank 1 "on another node" at 127.0.0.2 (the same port, another address, as on a real
second node). What SGLang does with its --nnodes flags is checked in tests/rollout/conformance/test_launch_and_pins.py.

The Ray part runs in a child process that joins the shared instance with its token (as the end-to-end runs'
``mrl train`` does): a test process cannot take up Ray's token after Ray read its settings.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ray_cluster import shared_ray

pytestmark = pytest.mark.slow  # Ray (the session's instance) and launcher actors

ROOT = Path(__file__).resolve().parents[2]

SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Health).serve_forever()
"""


def _alive(pid: int | None) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, TypeError):
        return False


def main(address: str, out: str) -> None:
    """Start, restart and stop one engine over two nodes; its node-rank 1 serves on its first two launches and
    exits (as an SGLang node that cannot join) on the third."""
    import urllib.request

    import ray

    from mrl.driver.engines import (
        EngineNode,
        EngineRestartError,
        EngineSlot,
        NodeLaunch,
        RemoteEngine,
    )
    from mrl.net import free_port

    ray.init(address=address, log_to_driver=False)
    tmp = Path(out)
    try:
        port, node = free_port(), ray.get_runtime_context().get_node_id()
        follower = EngineNode(1, node, "127.0.0.2", (), 1)
        slot = EngineSlot(0, node, "127.0.0.1", (), 0, f"http://127.0.0.1:{port}", port, followers=(follower,),
                          dist_init_port=1)
        head_cmd = [sys.executable, "-c", SERVER, "127.0.0.1", str(port)]
        third_fails = ("import pathlib, sys; f = pathlib.Path(sys.argv[3]); n = len(f.read_text()) if f.exists() else 0; "
                       "f.write_text('x' * (n + 1)); n < 2 or (print('node 1: rendezvous refused', flush=True), "
                       "sys.exit(5)); exec(" + repr(SERVER) + ")")
        launch = NodeLaunch(follower, [sys.executable, "-c", third_fails, "127.0.0.2", str(port), str(tmp / "launches")],
                            {}, tmp / "engine_0_node1.log", None)
        engine = RemoteEngine(slot, head_cmd, {}, tmp / "engine_0.log", 60.0, None, cuda=False, followers=(launch,))
        try:
            engine.start()
            engine.wait_healthy()  # returns once node-rank 0 answers /health: both nodes must be serving now
            for host in ("127.0.0.1", "127.0.0.2"):  # node-rank 0's API and node-rank 1's health server
                with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=10) as r:
                    assert r.status == 200, (host, r.status)
            pids = [p.pid for p in engine._procs]
            assert len(pids) == 2 and all(_alive(p) for p in pids) and pids[0] == engine.pid
            engine.restart()  # the pool's callback: a new node-rank 0 cannot rejoin the old group, every node restarts
            new = [p.pid for p in engine._procs]
            assert not any(_alive(p) for p in pids) and all(_alive(p) for p in new) and set(new).isdisjoint(pids)
            # node-rank 1 now dies at start: the wait ends with its exit code, not after node-rank 0's timeout
            try:
                engine.restart()
                raise AssertionError("a node that died at start went unnoticed")
            except EngineRestartError as e:
                assert f"restart of engine 0 (http://127.0.0.1:{port}) failed" in str(e) and "exited with code 5" in str(e), e
        finally:
            engine.stop()
        assert not any(_alive(p) for p in new) and "node 1: rendezvous refused" in (tmp / "engine_0_node1.log").read_text()
    finally:
        ray.shutdown()


def test_every_node_of_an_engine_is_launched_restarted_and_stopped_together(tmp_path: Path) -> None:
    address, auth = shared_ray()
    code = f"import sys; from {__name__} import main; main(sys.argv[1], sys.argv[2])"
    done = subprocess.run([sys.executable, "-c", code, address, str(tmp_path)], cwd=ROOT, env={**os.environ, **auth},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
