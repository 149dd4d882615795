"""The embedded engine inside a trainer rank's process (``rollout.weight_sync.transport=inprocess``).

On CPU with colocated engines the engine's process only ever runs while its rank waits, so it can as
well be a pair of threads in the rank: the scheduler thread and the HTTP server (the same FastAPI app
as ``mrl engine``, the same SGLang-protocol routes: the driver's client, pool and health checks see an
ordinary engine at ``http://host:port``). What changes is the weight sync: the rank copies its own
weights into the engine's model under the scheduler's model lock — no HTTP round trip, no shared-memory
segment, no barrier with the other ranks (every DP replica holds the whole model at TP = PP = 1, so each
rank loads its own engine). What that saves: docs/performance.md, 'auto: transport and shared prefix'.

Megatron's CPU redirect is per thread (:mod:`mrl.megatron.cpu_support`), so the engine's threads run
plain ``transformers`` code. A dead engine is a dead rank: there is no restart (config validation
refuses ``rollout.weight_sync.snapshot_dir`` with this transport).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import torch

from mrl.rollout.engine import weights as W
from mrl.rollout.engine.checksum import tensor_checksum
from mrl.rollout.engine.server import Engine, build_app
from mrl.rollout.weight_sync.sender import WeightSyncReport


class InProcessEngine:
    """An :class:`~mrl.rollout.engine.server.Engine` served on ``host:port`` from threads of this process."""

    def __init__(self, model_path: str, *, host: str, port: int, token: str | None, dtype: str, seed: int,
                 max_running: int | None = None, startup_timeout_s: float = 120.0,
                 enable_return_routed_experts: bool = False) -> None:
        """``enable_return_routed_experts``: ``mrl engine --enable-return-routed-experts`` (an MoE model; its
        ``/generate`` then honours ``return_routed_experts``, docs/moe.md)."""
        import uvicorn

        kw = {} if max_running is None else {"max_running": max_running}
        self.engine = Engine(model_path, device="cpu", dtype=dtype, seed=seed,
                             enable_return_routed_experts=enable_return_routed_experts, **kw)
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(build_app(self.engine, token=token), host=host, port=port, log_level="warning",
                                lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"mrl-engine-http-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"in-process engine at {self.url} did not start (port in use? see the rank's log)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"in-process engine at {self.url} did not start within {startup_timeout_s:.0f} s")
            time.sleep(0.01)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: str, *, verify: bool,
                     timeout_s: float) -> tuple[int, int]:
        """Copy ``named`` (HF names) into the model between two scheduler steps and set ``version``.

        Waits (up to ``timeout_s``) until nothing runs, as ``/flush_cache`` makes the other transports
        wait; validates every name and shape before copying anything. Returns (bytes, tensors)."""
        e = self.engine
        named = W.check_named(e.runner, [(n, t.detach()) for n, t in named])
        deadline = time.monotonic() + timeout_s
        while True:
            with e.scheduler.model_lock:
                if e.scheduler.is_idle(ignore_waiting=e.scheduler.paused):  # /flush_cache's rule
                    moved = W.load_into_model(e.runner, named)
                    e.set_version(version)
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"in-process engine {self.url} still busy after {timeout_s:.0f} s of waiting "
                                   "to load new weights")
            time.sleep(0.005)
        if verify:
            params = e.runner.named_weights()
            for n, t in named:
                if tensor_checksum(params[n]) != tensor_checksum(t):  # a rounding cast is a mismatch too
                    raise RuntimeError(f"weight sync {version}: tensor {n!r} differs in the in-process engine "
                                       "after the copy")
        return moved, len(named)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=timeout_s)


class InProcessSyncer:
    """The trainer rank's sender for ``transport=inprocess``, with the ``WeightSyncer`` interface the rank
    uses (``init``/``sync``/``rejoin``/``close``). It lives with the engine, not in ``mrl.rollout.weight_sync``:
    it holds the engine object itself, which the sender side never imports (tests/test_import_contract.py).
    No HTTP, no barrier: at TP = PP = 1 every DP replica holds the whole model, and rank r hosts engine r."""

    def __init__(self, engine: InProcessEngine, *, verify: bool, timeout_s: float = 300.0) -> None:
        self.engine, self.verify, self.timeout_s = engine, verify, timeout_s

    def init(self) -> None:
        pass  # nothing to connect: the engine is an object of this process

    def rejoin(self) -> None:
        pass  # an in-process engine is never restarted on its own (it dies with its rank)

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str, *,
             pause: bool = True) -> WeightSyncReport:
        """Load one full set of weights. ``pause`` is moot: the copy waits until the engine is idle and
        runs between two scheduler steps under the model lock, so nothing generates on half-new weights."""
        t0 = time.perf_counter()
        nbytes, ntensors = self.engine.load_weights(named_tensors, str(version), verify=self.verify,
                                                    timeout_s=self.timeout_s)
        return WeightSyncReport(str(version), "inprocess", time.perf_counter() - t0, nbytes, ntensors, 1, self.verify)

    def close(self) -> None:
        pass  # the rank stops its engine (TrainRank.close)
