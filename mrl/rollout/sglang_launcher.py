"""Launch an engine HTTP server as a child process and wait until it is healthy.

``rollout.engine: sglang`` runs ``python -m sglang.launch_server`` (GPU hosts); the embedded
engine (``python -m mrl.rollout.engine.server``) goes through the same ``EngineProcess`` code path with a
different command, which is how the launch/health/log-tail logic is tested on CPU.

Health: GET ``{url}/health`` every ``poll_s`` until HTTP 200 or ``startup_timeout_s``; if the child
exits first, ``EngineLaunchError`` carries its exit code and the last lines of its log.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# THE supported SGLang release: its HTTP protocol is what the weight sync and the rollout client speak
# (begin/end_weight_update, pause modes, flattened buckets; tests/rollout/conformance/ runs its code).
# Also pinned in setup.py's gpu extra, docker/Dockerfile and requirements-sglang-cpu.txt.
SGLANG_VERSION = "0.5.23"


def check_sglang_version(installed: str | None = None) -> str:
    """The installed SGLang's version; raises naming the fix when it is not the supported one
    (older releases lack /begin_weight_update and flattened-bucket loads, newer ones are untested)."""
    if installed is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("sglang")
        except PackageNotFoundError as e:
            raise EngineLaunchError(f"rollout.engine=sglang but SGLang is not installed; fix: pip install 'mrl[gpu]' "
                                    f"(sglang=={SGLANG_VERSION}) or use the docker image") from e
    if installed != SGLANG_VERSION:
        raise EngineLaunchError(f"SGLang {installed} is installed but mrl speaks SGLang {SGLANG_VERSION}'s protocol; "
                                f"fix: pip install sglang=={SGLANG_VERSION} (or use the docker image)")
    return installed


# The embedded engine exits when the process named here (its launcher) is gone (mrl/rollout/engine/server.py).
PARENT_PID_ENV = "MRL_ENGINE_PARENT_PID"


class EngineLaunchError(RuntimeError):
    """The engine child died or never became healthy; the message holds its log tail."""


@dataclass
class SGLangLaunchSpec:
    """Arguments of ``sglang.launch_server`` that mrl sets (names as SGLang's ServerArgs flags).

    tp_size: ``--tp-size``, GPUs per engine. mem_fraction_static: ``--mem-fraction-static``,
    share of GPU memory for weights + KV cache. colocated: engine shares GPUs with the trainer,
    so ``--enable-memory-saver`` lets ``/release_memory_occupation`` free the KV cache and weights.
    admin_api_key: ``--admin-api-key``, the per-run token: SGLang then requires it on its admin endpoints
    (pause, weight updates, memory release, ...) and leaves /generate and /health open — the embedded
    engine's model, so a router (sglang_router) can forward generations without the key.
    enable_return_routed_experts: ``--enable-return-routed-experts`` (MoE routing replay): the server
    captures each layer's top-k expert ids so ``/generate`` can return them (``return_routed_experts``).
    nnodes / node_rank / dist_init_addr: ``--nnodes``, ``--node-rank``, ``--dist-init-addr`` of an engine over
    several nodes: the same command runs once per node; node-rank ``r`` runs TP ranks ``[r·tp/nnodes,
    (r+1)·tp/nnodes)`` on GPUs from its own ``--base-gpu-id``, all meet at ``dist_init_addr`` (``ip:port`` of
    node-rank 0, torch.distributed's rendezvous); only node-rank 0 serves the API, the others answer /health.
    """

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    mem_fraction_static: float = 0.8
    colocated: bool = False
    skip_server_warmup: bool = True
    base_gpu_id: int | None = None
    dtype: str | None = None
    random_seed: int | None = None
    admin_api_key: str | None = None
    enable_return_routed_experts: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"rollout.tp_size must be >= 1, got {self.tp_size}")
        if self.nnodes > 1 and (not self.dist_init_addr or self.tp_size % self.nnodes
                                or not 0 <= self.node_rank < self.nnodes):
            raise ValueError(f"an engine over nnodes={self.nnodes} needs dist_init_addr (node-rank 0's ip:port), "
                             f"0 <= node_rank < nnodes and tp_size divisible by nnodes; got node_rank={self.node_rank}, "
                             f"tp_size={self.tp_size}, dist_init_addr={self.dist_init_addr!r}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"rollout.gpu_memory_utilization (--mem-fraction-static) must be in (0, 1), got {self.mem_fraction_static}"
            )


#: SSM-state dtype of hybrid (linear-attention) models: the trainer's and transformers' recurrent state is fp32
HYBRID_SSM_DTYPE = "float32"


def is_hybrid_checkpoint(model_path: str) -> bool:
    """``model_path/config.json`` (or its ``text_config``) lists ``linear_attention`` layers (Qwen3.5 / Qwen3.6,
    Qwen3-Next). False when there is no readable config.json there (a hub id: SGLang resolves it itself)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = cfg.get("text_config") or cfg
    return "linear_attention" in (text.get("layer_types") or cfg.get("layer_types") or [])


def build_sglang_command(spec: SGLangLaunchSpec, python: str = sys.executable) -> list[str]:
    """The argv of ``python -m sglang.launch_server`` for one engine (flags checked against SGLang's
    own ServerArgs parser in tests/rollout/conformance/test_launch_and_pins.py).

    Hybrid checkpoints (:func:`is_hybrid_checkpoint`): SGLang 0.5.23 recognises their architectures and sets up
    its hybrid (mamba) state pool and radix-cache strategy itself; we pin ``--mamba-ssm-dtype float32`` so the
    rollout's recurrent state does not fall to a ``mamba_ssm_dtype`` a config.json may name (bf16), which would
    move its log-probs away from the trainer's fp32 state. A ``--mamba-ssm-dtype`` in ``extra_args`` comes
    later on the command line and wins."""
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", str(spec.model_path),
        "--host", spec.host,
        "--port", str(spec.port),
        "--tp-size", str(spec.tp_size),
        "--mem-fraction-static", str(spec.mem_fraction_static),
        "--trust-remote-code",
    ]
    if spec.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    if spec.colocated:
        cmd.append("--enable-memory-saver")
    if spec.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(spec.base_gpu_id)]
    if spec.dtype:
        cmd += ["--dtype", spec.dtype]
    if spec.random_seed is not None:
        cmd += ["--random-seed", str(spec.random_seed)]
    if spec.admin_api_key:
        cmd += ["--admin-api-key", spec.admin_api_key]
    if spec.enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if is_hybrid_checkpoint(spec.model_path):
        cmd += ["--mamba-ssm-dtype", HYBRID_SSM_DTYPE]
    if spec.nnodes > 1:
        cmd += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank), "--dist-init-addr", str(spec.dist_init_addr)]
    return cmd + list(spec.extra_args)


def build_embedded_command(
    model_path: str, port: int, host: str = "127.0.0.1", token_env: str | None = None, python: str = sys.executable,
    device: str | None = None, dtype: str | None = None, seed: int | None = None,
    enable_return_routed_experts: bool = False,
) -> list[str]:
    """The argv of the embedded engine (``rollout.engine: torch``), same CLI shape. The control
    token travels in the environment variable ``token_env`` (pass it in ``EngineProcess(env=)``),
    not in argv, which other users of the host can read. ``device``/``dtype``/``seed``: the
    server's defaults (cpu, float32, 0) when None. ``enable_return_routed_experts``: SGLang's flag, same
    meaning (an MoE model)."""
    cmd = [python, "-m", "mrl.rollout.engine.server", "--model", str(model_path), "--host", host, "--port", str(port)]
    if token_env:
        cmd += ["--token-env", token_env]
    for flag, value in (("--device", device), ("--dtype", dtype), ("--seed", seed)):
        if value is not None:
            cmd += [flag, str(value)]
    if enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    return cmd


def wait_for_health(url: str, timeout_s: float, poll_s: float = 0.5, health_path: str = "/health") -> float:
    """Poll ``url + health_path`` until HTTP 200 (an engine someone else launched); returns the
    seconds waited or raises TimeoutError naming the url."""
    t0 = time.monotonic()
    with httpx.Client(timeout=max(poll_s, 2.0), trust_env=False) as client:
        while True:
            try:
                if client.get(url.rstrip("/") + health_path).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"engine at {url} not healthy after {timeout_s:.0f}s")
            time.sleep(poll_s)


class EngineProcess:
    """One engine server in a child process: start, wait healthy, log tail, stop, restart.

    The child writes stdout+stderr to ``log_path``; it runs in its own session so that ``stop``
    ends the server and whatever workers it spawned (SGLang starts scheduler processes).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        url: str,
        log_path: str | os.PathLike,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        poll_s: float = 0.5,
        health_path: str = "/health",
    ) -> None:
        self.cmd = list(cmd)
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        self.health_path = health_path
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def get_pid(self) -> int | None:
        """The server's pid (= its process group: it leads its own session); for a remote owner."""
        return self.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, wait: bool = True) -> None:
        if self.alive():
            raise RuntimeError(f"engine at {self.url} already running (pid {self.pid}); call stop() first")
        if "sglang.launch_server" in self.cmd:
            check_sglang_version()  # on the engine's node, in the interpreter that will run SGLang
        self._check_port_free()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the child
        env = dict(os.environ) if self.env is None else {**os.environ, **self.env}
        env[PARENT_PID_ENV] = str(os.getpid())
        self._proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        if wait:
            self.wait_healthy()

    def _check_port_free(self) -> None:
        """Refuse a port something already listens on (another run's engine, say): the child would only fail to
        bind after its imports, while that other server answered this URL's /health -- and the run would
        generate with another run's weights until a version check caught it."""
        import socket
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        with socket.socket(socket.AF_INET6 if ":" in (u.hostname or "") else socket.AF_INET) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
            try:
                sock.bind((u.hostname or "127.0.0.1", u.port or 80))
            except OSError as e:
                raise EngineLaunchError(
                    f"engine at {self.url}: port {u.port} is already in use on this node ({e.strerror}), by another "
                    "run's engine or another program; fix: rollout.port_base=<a free range> (engine i binds "
                    "port_base + i; a judge's engines reward.judge.port_base + i, default rollout.port_base + 100), or "
                    "stop that process") from None

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                tail = deque(f, maxlen=lines)
        except FileNotFoundError:
            return "<no log written>"
        return b"".join(tail).decode("utf-8", "replace")

    def wait_healthy(self, timeout_s: float | None = None) -> float:
        """Poll ``/health`` until 200; returns seconds waited. Raises EngineLaunchError with the
        log tail if the child exits or the timeout passes (the child is then stopped)."""
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        last = "no answer yet"
        with httpx.Client(timeout=max(self.poll_s, 2.0), trust_env=False) as client:
            while True:
                if self._proc is None:
                    raise EngineLaunchError(f"engine at {self.url} was never started; call start()")
                code = self._proc.poll()
                if code is not None:
                    raise EngineLaunchError(
                        f"engine at {self.url} exited with code {code} before becoming healthy.\n"
                        f"command: {' '.join(self.cmd)}\nlog tail ({self.log_path}):\n{self.log_tail()}"
                    )
                try:
                    r = client.get(self.url + self.health_path)
                    if r.status_code == 200:
                        return time.monotonic() - t0
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last = type(e).__name__
                if time.monotonic() - t0 > timeout_s:
                    tail = self.log_tail()
                    self.stop()
                    raise EngineLaunchError(
                        f"engine at {self.url} not healthy after {timeout_s:.0f}s (last: {last}); raise "
                        f"rollout.engine_startup_timeout_s if the model is large.\nlog tail ({self.log_path}):\n{tail}"
                    )
                time.sleep(self.poll_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """SIGKILL the server only (simulates a crash; tests and fault handling)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=15)

    def restart(self) -> None:
        """The restart callback the pool calls for an unhealthy engine (same url, same command)."""
        self.stop()
        self.start(wait=True)


class EngineLauncher(EngineProcess):
    """``EngineProcess`` as the Ray actor that owns the engine's process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from mrl.quiet_stop import quiet_stop_in_finalizers

        quiet_stop_in_finalizers()  # ray.kill at the end of a run: no traceback on the driver's console
        super().__init__(*args, **kwargs)


def make_engine_actor_class():
    """Ray actor wrapping ``EngineProcess`` (one per engine, placed on the engine's GPUs by the
    cluster layer). Imported lazily so rollout code does not need Ray at import time."""
    import ray

    return ray.remote(num_cpus=0)(EngineLauncher)
