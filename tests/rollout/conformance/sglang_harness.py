"""One SGLang engine's control plane on CPU, built from SGLang's own code (the pinned release).

    python -m tests.rollout.conformance.sglang_harness --port P --weights model.safetensors

What runs is SGLang's: the FastAPI ``app`` of ``sglang.srt.entrypoints.http_server`` (its routes,
request parsing through the ``io_struct`` schemas, status codes), the scheduler-side
``SchedulerWeightUpdaterManager`` (the begin/end weight-update session, flush-after-update rule,
weight-version bookkeeping) and the model-runner ``WeightUpdater`` (``init_custom_process_group``
with its ``PrefixStore``, per-tensor and ``flattened_bucket`` receive through
``FlattenedTensorBucket``, destroy group), over gloo.

What stands in for the parts that need a GPU or a full server (this file): the model is a module
of plain parameters under HF names whose ``load_weights`` copies by name (SGLang's models map HF
names to fused parameters; the protocol is the same); the tokenizer manager forwards each call
to the manager above in-process instead of over ZMQ, and keeps SGLang's pause/flush rule
(``Scheduler.flush_cache``: refused unless idle, waiting requests ignored while paused; pause
modes abort / retract / in_place) over counters of simulated requests that the test sets with
``POST /harness/requests``. ``GET /harness/checksums`` reports what the model holds.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist


class HFNamedModel(torch.nn.Module):
    """Parameters under HF names (dots kept in a dict); ``load_weights`` as SGLang models have it."""

    def __init__(self, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        super().__init__()
        self.weights = {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
        self.loads = 0

    def load_weights(self, named) -> None:
        for name, t in named:
            if name not in self.weights:
                raise KeyError(f"unknown weight {name!r}")
            dst = self.weights[name]
            if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
                raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype}, model has {tuple(dst.shape)} {dst.dtype}")
            dst.copy_(t)
        self.loads += 1


def build(weights_file: str):
    from safetensors import safe_open

    # SGLang's server publishes its resolved ServerArgs as config namespaces at start-up; the weight
    # path reads one value from them (--weight-cache-mode, default "off"). Publish just that.
    from sglang.srt import runtime_context
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.managers import io_struct as io
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.model_runner_components.weight_updater import (
        WeightUpdater,
    )

    bags = runtime_context._CONTEXT._config_bags
    runtime_context._CONTEXT._config_bags = {**(bags or {}), "model": SimpleNamespace(weight_cache_mode="off")}

    with safe_open(weights_file, "pt") as f:
        shapes = {k: (f.get_slice(k).get_shape(), f.get_tensor(k).dtype) for k in f.keys()}  # noqa: SIM118
    model = HFNamedModel({k: (torch.Size(s), d) for k, (s, d) in shapes.items()})

    class Runner:  # the object SGLang's weight ops reach as "model runner"
        def __init__(self) -> None:
            self.weight_updater = WeightUpdater(
                tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                recapture_cuda_graph=lambda: None, get_model_runner=lambda: self)

    class TpWorker:  # SGLang's TpModelWorker methods, on our runner
        init_weights_update_group = TpModelWorker.init_weights_update_group
        destroy_weights_update_group = TpModelWorker.destroy_weights_update_group
        weight_update_runners = TpModelWorker.weight_update_runners

        def __init__(self) -> None:
            self.model_runner = self._model_runner = Runner()

    state = SimpleNamespace(running=0, waiting=0, paused=False, weight_version="default", calls=[])

    def is_fully_idle(ignore_waiting: bool = False) -> bool:
        return state.running == 0 and (ignore_waiting or state.waiting == 0)

    class Manager(SchedulerWeightUpdaterManager):
        def __post_init__(self) -> None:  # SGLang reads its TP group from its parallel state
            self.tp_cpu_group = dist.group.WORLD

    mgr = Manager(tp_worker=TpWorker(), draft_worker=None, memory_saver_adapter=None,
                  flush_cache=lambda empty_cache=True: is_fully_idle(ignore_waiting=state.paused),
                  is_fully_idle=is_fully_idle,
                  scheduler=SimpleNamespace(record_weight_version_change=lambda new_version: (
                      setattr(state, "weight_version", new_version) if new_version is not None else None)))

    def call(fn, obj):
        state.calls.append(type(obj).__name__)
        out = fn(obj)
        return out.success, out.message

    class TokenizerManager:  # SGLang's TokenizerManager interface, in-process
        server_args = SimpleNamespace(api_key=None, admin_api_key=None)

        async def init_weights_update_group(self, obj, request=None):
            return await asyncio.to_thread(call, mgr.init_weights_update_group, obj)

        async def destroy_weights_update_group(self, obj, request=None):
            return await asyncio.to_thread(call, mgr.destroy_weights_update_group, obj)

        async def begin_weight_update(self, obj, request=None):
            return await asyncio.to_thread(call, mgr.begin_weight_update, obj)

        async def end_weight_update(self, obj, request=None):
            return await asyncio.to_thread(call, mgr.end_weight_update, obj)

        async def update_weights_from_distributed(self, obj, request=None):
            return await asyncio.to_thread(call, mgr.update_weights_from_distributed, obj)

        async def update_weights_from_tensor(self, obj, request=None):
            state.calls.append(type(obj).__name__)
            # SGLang would deserialize CUDA IPC handles here (needs GPUs); the schema was checked.
            return False, "harness: update_weights_from_tensor needs CUDA IPC"

        async def pause_generation(self, obj):
            state.calls.append(f"pause:{obj.mode}")
            state.paused = True
            if obj.mode == "abort":
                state.running = state.waiting = 0
            elif obj.mode == "retract":
                state.waiting, state.running = state.waiting + state.running, 0

        async def continue_generation(self, obj):
            state.calls.append("continue")
            state.paused = False

        async def flush_cache(self, timeout_s=None):
            state.calls.append("flush")
            ok = is_fully_idle(ignore_waiting=state.paused)
            return io.FlushCacheReqOutput(success=ok, message=None if ok else "Cache not flushed: pending requests")

    hs.set_global_state(hs._GlobalState(tokenizer_manager=TokenizerManager(), template_manager=None,
                                        scheduler_info={}))
    app = hs.app

    @app.post("/harness/requests")
    async def set_requests(body: dict):
        state.running, state.waiting = int(body.get("running", 0)), int(body.get("waiting", 0))
        return {"ok": True}

    @app.get("/harness/checksums")
    async def checksums():
        from mrl.rollout.engine.checksum import tensor_checksum

        return {"checksums": {n: tensor_checksum(t) for n, t in model.weights.items()},
                "weight_version": state.weight_version, "calls": state.calls, "loads": model.loads,
                "groups": sorted(mgr.tp_worker.model_runner.weight_updater._model_update_group)}

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--weights", required=True)
    args = ap.parse_args()
    sys.path.insert(0, os.getcwd())
    from tests.helpers.sglang_real import require

    require()
    # SGLang's engine processes always have a default group (its model runner asserts it).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    import uvicorn

    uvicorn.run(build(args.weights), host="127.0.0.1", port=args.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
