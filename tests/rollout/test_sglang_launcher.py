"""SGLang launcher: argv building from config, and the launch / health / log-tail path run for
real with the embedded engine's command (SGLang itself cannot run on these CPU hosts)."""
from __future__ import annotations

import sys

import pytest

from mrl.rollout.sglang_launcher import (
    EngineLaunchError,
    EngineProcess,
    SGLangLaunchSpec,
    build_embedded_command,
    build_sglang_command,
)
from tests.helpers.dist import free_port


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_sglang_command_from_config():
    spec = SGLangLaunchSpec(model_path="/m/qwen", port=30001, tp_size=2, mem_fraction_static=0.55,
                            colocated=True, base_gpu_id=2, random_seed=3, admin_api_key="tok")
    cmd = build_sglang_command(spec, python="py")
    assert cmd[:3] == ["py", "-m", "sglang.launch_server"]
    assert _flag(cmd, "--model-path") == "/m/qwen" and _flag(cmd, "--port") == "30001"
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--tp-size") == "2"
    assert _flag(cmd, "--mem-fraction-static") == "0.55" and _flag(cmd, "--base-gpu-id") == "2"
    assert _flag(cmd, "--admin-api-key") == "tok" and _flag(cmd, "--random-seed") == "3"
    assert "--skip-server-warmup" in cmd and "--enable-memory-saver" in cmd
    plain = build_sglang_command(SGLangLaunchSpec(model_path="/m", port=1, skip_server_warmup=False))
    assert "--enable-memory-saver" not in plain and "--skip-server-warmup" not in plain and "--admin-api-key" not in plain
    assert build_embedded_command("/m", 5, host="10.0.0.2", token_env="MRL_TOKEN", python="py") == [
        "py", "-m", "mrl.rollout.engine.server", "--model", "/m", "--host", "10.0.0.2", "--port", "5",
        "--token-env", "MRL_TOKEN"]
    assert build_embedded_command("/m", 5, enable_return_routed_experts=True)[-1] == "--enable-return-routed-experts"
    assert "--enable-return-routed-experts" not in plain
    moe = build_sglang_command(SGLangLaunchSpec(model_path="/m", port=1, enable_return_routed_experts=True))
    assert "--enable-return-routed-experts" in moe
    with pytest.raises(ValueError, match="mem-fraction-static"):
        SGLangLaunchSpec(model_path="/m", port=1, mem_fraction_static=1.5)


def test_child_that_dies_reports_exit_code_and_log_tail(tmp_path):
    # A stand-in child that fails the way a server with a bad --model-path does (message, exit 3);
    # the real embedded engine goes through start/wait_healthy/restart in test_pool_router.py.
    port = free_port()
    cmd = [sys.executable, "-c", ("import sys; print('loading /m/no_such_model', flush=True); "
           "print('FileNotFoundError: no_such_model/config.json', file=sys.stderr); sys.exit(3)")]
    p = EngineProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "e.log", startup_timeout_s=60, poll_s=0.2)
    with pytest.raises(EngineLaunchError, match="exited with code 3") as ei:
        p.start()
    assert "FileNotFoundError: no_such_model/config.json" in str(ei.value)  # stderr lands in the tail
    assert "loading /m/no_such_model" in p.log_tail(lines=5)
    assert not p.alive()


def test_a_port_in_use_is_refused_before_the_child_starts(tmp_path):
    # another run's engine on the same port would answer this URL's /health while our child fails to bind
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        p = EngineProcess([sys.executable, "-c", "print('started')"], f"http://127.0.0.1:{port}", tmp_path / "e.log",
                          startup_timeout_s=5, poll_s=0.2)
        with pytest.raises(EngineLaunchError, match=f"port {port} is already in use.*rollout.port_base"):
            p.start()
        assert p._proc is None and not (tmp_path / "e.log").exists()  # nothing was launched


def test_child_that_never_answers_times_out_and_is_stopped(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-c", "import time; print('warming up', flush=True); time.sleep(120)"]
    p = EngineProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "e.log", startup_timeout_s=1.5, poll_s=0.2)
    with pytest.raises(EngineLaunchError, match="not healthy after") as ei:
        p.start()
    assert "warming up" in str(ei.value)
    assert not p.alive()

# Launching the embedded engine through EngineProcess.start/wait_healthy/restart runs for real in
# tests/rollout/test_pool_router.py (fixture + the kill/restart test).


LAUNCHER = """
import sys, time
from mrl.rollout.sglang_launcher import EngineProcess, build_embedded_command
p = EngineProcess(build_embedded_command(sys.argv[1], int(sys.argv[2])), "http://127.0.0.1:" + sys.argv[2], sys.argv[3],
                  startup_timeout_s=180)
p.start(wait=True)
print(p.get_pid(), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_embedded_server_exits_when_its_launcher_is_killed(tmp_path):
    """A launcher killed without stop() (a Ray actor killed at teardown) must not leave its server
    serving: the server runs in its own session, so it watches its parent itself."""
    import os
    import subprocess
    import time

    from tests.helpers.tiny_models import make_tiny_hf

    model = make_tiny_hf(tmp_path / "m", "qwen2")
    port = free_port()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(model), str(port), str(tmp_path / "e.log")],
                                stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(launcher.stdout.readline())
        os.kill(server_pid, 0)  # serving
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(server_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(server_pid, 9)
            pytest.fail(f"server {server_pid} outlived its launcher by 30 s")
        assert "launcher" in (tmp_path / "e.log").read_text() and "is gone; exiting" in (tmp_path / "e.log").read_text()
    finally:
        launcher.kill()
