"""HTTP server of the embedded engine, speaking SGLang's native protocol (``mrl engine``).

    mrl engine --model HF_DIR --port P [--host 127.0.0.1] [--token-env VAR | --token T] [--api-key-env VAR]
               [--max-running N] [--device cpu|cuda] [--dtype float32] [--seed S]
               [--enable-return-routed-experts]
    python -m mrl.rollout.engine.server (same arguments)

Security: binds 127.0.0.1 by default. When a token is configured, every control endpoint
(everything except /generate, /health*, /model_info, /server_info and their /get_* aliases,
/get_weight_version and the OpenAI /v1 routes: SGLang's NORMAL auth level) requires
``Authorization: Bearer <token>``; the
server refuses to bind a non-loopback address without one. ``--api-key-env VAR`` (SGLang's ``--api-key``)
adds a key that every route but /health* requires, /generate and /v1 included: an OpenAI-compatible server
for outside clients (e.g. a judge, docs/judge.md). Requests are JSON only; tensors
arrive from disk (safetensors), shared memory or torch.distributed, never pickled.

Routed experts (MoE models): started with ``--enable-return-routed-experts`` (SGLang's flag), the engine
hooks the routers and ``/generate`` honours ``return_routed_experts`` (encoding: mrl/rollout/protocol.py
``GenerateReqInput``). Without the flag such a request is refused with 400 naming the flag; SGLang 0.5.23
instead answers without ``meta_info["routed_experts"]``, which mrl's client reports as an error
(docs/moe.md).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import os
import sys
import time

import torch
from fastapi import Depends, FastAPI, HTTPException
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mrl.net import is_loopback
from mrl.rollout import protocol as P
from mrl.rollout.engine import server_info as I
from mrl.rollout.engine import serving as S
from mrl.rollout.engine import weights as W
from mrl.rollout.engine.checksum import tensor_checksum
from mrl.rollout.engine.model_runner import ModelRunner
from mrl.rollout.engine.openai_api import add_openai_routes
from mrl.rollout.engine.scheduler import (
    EngineBusy,
    EngineLimits,
    Request,
    RequestTooLarge,
    Scheduler,
)
from mrl.rollout.sglang_launcher import PARENT_PID_ENV

# Sequences decoded together by default: vLLM's classic max_num_seqs. The quickstart sends 128 samples
# per engine; at 64 they ran in two waves (docs/performance.md, '256 sequences per engine').
# The KV buffers grow with the rows actually admitted, not with this cap.
MAX_RUNNING = 256
SHUTDOWN_GRACE_S = 2  # seconds open requests get after SIGTERM (then cancelled; the engine exits within 5 s)


class Engine:
    """Model runner + scheduler + weight-update groups of one server."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32",
                 max_running: int = MAX_RUNNING, seed: int = 0, enable_return_routed_experts: bool = False,
                 limits: EngineLimits | None = None) -> None:
        self.runner = ModelRunner(model_path, device=device, dtype=dtype, capture_routing=enable_return_routed_experts)
        self.enable_return_routed_experts = enable_return_routed_experts
        self.scheduler = Scheduler(self.runner, max_running=max_running, seed=seed, limits=limits or EngineLimits())
        self.groups = W.DistGroups(self.runner.device)
        # resume_memory_occupation restores the --model checkpoint, then the last directory
        # loaded by /update_weights_from_disk (which may hold only a subset, e.g. one PP stage).
        self.model_path = model_path
        self.last_disk_path: str | None = None
        # SGLang >= 0.5.22: distributed/tensor weight updates only inside begin/end_weight_update.
        self.weight_update_open = False

    def set_version(self, requested: str | None) -> str:
        s = self.scheduler
        if requested is not None:
            s.weight_version = str(requested)
        else:
            s.weight_version = str(int(s.weight_version) + 1) if s.weight_version.isdigit() else "1"
        return s.weight_version


def build_app(engine: Engine, token: str | None = None, api_key: str | None = None) -> FastAPI:
    """FastAPI app over ``engine``; ``token`` (if any) guards the control endpoints; ``api_key`` (SGLang's
    ``--api-key``) every route but /health*, /generate and the OpenAI /v1 routes included."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.scheduler.start()
        yield
        # stopping (SIGTERM): what still runs finishes as aborted now, not after its last token
        engine.scheduler.abort_many(set(), abort_all=True, message="the engine is shutting down")
        engine.scheduler.shutdown()

    app = FastAPI(title="mrl embedded engine (SGLang protocol)", lifespan=lifespan)
    sched, runner = engine.scheduler, engine.runner

    def control(request: HTTPRequest) -> None:
        if token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "control endpoint: send 'Authorization: Bearer <token>' (the engine's --token)")

    ctl = [Depends(control)]
    if api_key is not None:
        @app.middleware("http")
        async def require_api_key(request: HTTPRequest, call_next):
            # as SGLang's add_api_key_middleware: health probes stay open, everything else needs the key
            got = request.headers.get("authorization", "")
            if request.url.path.startswith("/health") or hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                return await call_next(request)
            return JSONResponse({"error": {"message": "send 'Authorization: Bearer <api key>' (the engine's "
                                           "--api-key-env)"}}, status_code=401)

    def bad_request(e: Exception) -> JSONResponse:
        return JSONResponse({"error": {"message": str(e)}}, status_code=400)

    @app.post("/generate")
    async def generate(body: P.GenerateReqInput, http: HTTPRequest):
        if runner.released:
            return JSONResponse({"error": {"message": "weights released; call /resume_memory_occupation"}}, status_code=503)
        if body.return_routed_experts and not engine.enable_return_routed_experts:
            return bad_request(ValueError("return_routed_experts: this engine was started without "
                                          "--enable-return-routed-experts; restart it with the flag (an MoE model)"))
        t0 = time.monotonic()
        try:
            _check_request_size(body, sched.limits)
            jobs = []
            for i in range(body.batch_size):  # SGLang's order: prompt-major, then the n samples
                text, ids, sp, lp, rid = body.item(i)
                start, top = body.logprob_options(i)
                ids = S.encode(engine, text) if ids is None else ids
                ids, vision = S.prepare_images(engine, ids, body.images(i))  # once per prompt, not per sample
                jobs += [S.new_job(engine, ids, sp, lp, start, top, rid if sp.n == 1 or rid is None else f"{rid}_{j}",
                                   body.return_routed_experts, body.routed_experts_start_len, vision)
                         for j in range(sp.n)]
            await S.run(engine, jobs)
        except EngineBusy as e:
            return JSONResponse({"error": {"message": str(e)}}, status_code=503)
        except ValueError as e:
            return bad_request(e)
        listed = body.is_batch or len(jobs) > 1  # n > 1 answers a list, as SGLang does
        if body.stream:
            async def events():
                async with contextlib.aclosing(S.progress(engine, http, jobs)) as progress:  # closed -> aborts
                    async for k, err in progress:
                        if err is not None:
                            yield err
                            continue
                        out = S.native_output(engine, jobs[k], t0, body.return_text_in_logprobs,
                                              jobs[k].req.future.done())
                        yield S.sse({**out, "index": k} if listed else out)
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        if not await S.wait_all(engine, http, jobs):
            return Response(status_code=499)  # client closed the request; nobody reads this
        outs = [S.native_output(engine, j, t0, body.return_text_in_logprobs) for j in jobs]
        # Plain JSON types already: JSONResponse skips FastAPI's jsonable_encoder walk over every
        # log-prob entry (docs/performance.md, 'Plain JSON responses').
        return JSONResponse(outs if listed else outs[0])

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if sched.paused or runner.released:
            return Response(status_code=200)  # alive; generating now would wait for /continue
        req = Request(prompt_ids=[0], params=P.SamplingParams(max_new_tokens=1, temperature=0.0))
        await asyncio.wait_for(asyncio.wrap_future(sched.submit(req)), timeout=60)
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return I.model_info(engine)

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": sched.weight_version}

    # SGLang serves both at its NORMAL auth level, like /generate: open where /generate is.
    started = time.time()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return I.server_info(engine, started)

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=ctl)
    async def flush_cache():
        # SGLang's rule: refused (400) while requests run, or wait unless the engine is paused.
        # No prefix cache is kept across requests here, so there is nothing to drop; the KV buffers
        # stay allocated, as SGLang's KV pool does (/release_memory_occupation gives them back).
        # Freeing them here made every step after a weight sync (which flushes) allocate and
        # zero-fill them again, a page fault at a time (docs/vs_trl.md has the cost).
        if not sched.is_idle(ignore_waiting=sched.paused):
            return Response(f"Cache not flushed because there are pending requests. #queue-req: {sched.num_waiting}, "
                            f"#running-req: {sched.num_running}\n", status_code=400)
        return Response("Cache flushed.", status_code=200)

    @app.post("/pause_generation", dependencies=ctl)
    async def pause_generation(body: P.PauseGenerationReqInput | None = None):
        mode = (body or P.PauseGenerationReqInput()).mode
        n = await asyncio.to_thread(sched.pause, mode)
        return {"message": "Generation paused successfully.", "status": "ok", "mode": mode, "num_paused_requests": n}

    @app.post("/continue_generation", dependencies=ctl)
    async def continue_generation():
        sched.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/begin_weight_update", dependencies=ctl)
    async def begin_weight_update(body: P.WeightUpdateSessionReqInput | None = None):
        if engine.weight_update_open:
            return JSONResponse({"success": False, "message": "a weight-update session is already open; "
                                 "call end_weight_update() first"}, status_code=400)
        engine.weight_update_open = True
        return {"success": True, "message": "Success"}

    @app.post("/end_weight_update", dependencies=ctl)
    async def end_weight_update(body: P.WeightUpdateSessionReqInput | None = None):
        if not engine.weight_update_open:
            return JSONResponse({"success": False, "message": "no weight-update session is open; "
                                 "call begin_weight_update() first"}, status_code=400)
        engine.weight_update_open = False
        return {"success": True, "message": "Success"}

    def outside_window(route: str) -> JSONResponse | None:
        if engine.weight_update_open:
            return None
        return JSONResponse({"success": False, "message": f"{route} must run between begin_weight_update() and "
                             "end_weight_update()"}, status_code=400)

    @app.post("/abort_request", dependencies=ctl)
    async def abort_request(body: P.AbortReqInput):
        n = await asyncio.to_thread(sched.abort, body.rid, body.abort_all)
        return {"success": True, "num_aborted": n}

    async def _apply(named_fn, version: str | None, abort_all: bool, flush: bool) -> JSONResponse:
        """Receive (off the event loop), then copy under the model lock and bump the version."""
        if abort_all:
            await asyncio.to_thread(sched.abort, "", True, "aborted for a weight update")
        try:
            named = await asyncio.to_thread(named_fn)

            def _load() -> tuple[int, str]:
                with sched.model_lock:
                    return W.load_into_model(runner, named), engine.set_version(version)

            moved, ver = await asyncio.to_thread(_load)
        except (KeyError, ValueError, FileNotFoundError, RuntimeError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        if flush and not sched.is_idle(ignore_waiting=sched.paused):
            # SGLang's answer when flush_cache=true meets running requests (the weights did change).
            return JSONResponse({"success": False, "message": "Weights were updated, but the cache was not flushed "
                                 "because requests are still running or queued. Retract or finish them, then call "
                                 "/flush_cache."}, status_code=400)
        return JSONResponse({"success": True, "message": f"updated {len(named)} tensors ({moved} bytes)",
                             "weight_version": ver, "num_paused_requests": sched.num_running})

    @app.post("/update_weights_from_disk", dependencies=ctl)
    async def update_weights_from_disk(body: P.UpdateWeightFromDiskReqInput):
        if body.load_format not in (None, "auto", "safetensors"):
            return bad_request(ValueError(f"load_format {body.load_format!r}: only safetensors directories are supported"))
        resp = await _apply(lambda: W.read_disk(runner, body.model_path), body.weight_version, body.abort_all_requests,
                            body.flush_cache)
        if resp.status_code == 200:
            engine.last_disk_path = body.model_path
        return resp

    @app.post("/update_weights_from_tensor", dependencies=ctl)
    async def update_weights_from_tensor(body: P.UpdateWeightsFromTensorReqInput):
        if (refused := outside_window("update_weights_from_tensor")) is not None:
            return refused
        if body.serialized_named_tensors:
            return bad_request(ValueError(
                "serialized_named_tensors (pickled tensors) are refused by the embedded engine; "
                "send shm_tensors (POSIX shared-memory metadata, see docs/rollout.md)"))
        return await _apply(lambda: W.read_shm(runner, body.shm_tensors), body.weight_version, body.abort_all_requests,
                            body.flush_cache)

    @app.post("/init_weights_update_group", dependencies=ctl)
    async def init_weights_update_group(body: P.InitWeightsUpdateGroupReqInput):
        try:
            await asyncio.to_thread(engine.groups.init, body.master_address, body.master_port, body.rank_offset,
                                    body.world_size, body.group_name, body.backend)
        except Exception as e:  # noqa: BLE001 - report rendezvous failures to the caller
            return JSONResponse({"success": False, "message": f"init_weights_update_group failed: {e}"}, status_code=400)
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}/{body.world_size}"}

    @app.post("/destroy_weights_update_group", dependencies=ctl)
    async def destroy_weights_update_group(body: P.DestroyWeightsUpdateGroupReqInput):
        try:
            engine.groups.destroy(body.group_name)
        except KeyError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return {"success": True, "message": f"destroyed {body.group_name}"}

    @app.post("/update_weights_from_distributed", dependencies=ctl)
    async def update_weights_from_distributed(body: P.UpdateWeightsFromDistributedReqInput):
        if (refused := outside_window("update_weights_from_distributed")) is not None:
            # SGLang refuses before joining the broadcast; the sender's broadcast then fails on its
            # timeout. Our sender never does this (it opens the window first).
            return refused
        return await _apply(lambda: engine.groups.receive(runner, body), body.weight_version, body.abort_all_requests,
                            body.flush_cache)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"], dependencies=ctl)
    async def get_weights_by_name(body: P.GetWeightsByNameReqInput):
        p = runner.named_weights().get(body.name)
        if p is None:
            return bad_request(KeyError(f"no parameter {body.name!r}"))
        return p.detach()[: body.truncate_size].float().cpu().tolist()

    @app.post("/weights_checksum", dependencies=ctl)
    async def weights_checksum(body: P.WeightsChecksumReqInput):
        params = runner.named_weights()
        names = body.names if body.names is not None else list(params)
        missing = [n for n in names if n not in params]
        if missing:
            return bad_request(KeyError(f"unknown weight names {missing[:5]}"))

        def _sums() -> dict[str, str]:
            with sched.model_lock:
                return {n: tensor_checksum(params[n]) for n in names}

        return {"checksums": await asyncio.to_thread(_sums), "weight_version": sched.weight_version}

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"], dependencies=ctl)
    async def release_memory_occupation(body: P.MemoryOccupationReqInput | None = None):
        body = body or P.MemoryOccupationReqInput()
        if not sched.is_idle(ignore_waiting=sched.paused):  # SGLang asserts the same
            return JSONResponse({"success": False, "message": "release_memory_occupation should be called only when "
                                 "server is idle (pause_generation first)"}, status_code=400)

        def _rel() -> str:
            with sched.model_lock:
                weights = runner.release() if body.released("weights") and not runner.released else 0
                kv = sched.free_idle_cache() if body.released("kv_cache") else 0
                if runner.device.type == "cuda":  # else torch's cache keeps it: the colocated trainer is another process
                    torch.cuda.empty_cache()
                return f"released {weights} bytes of weights and {kv} bytes of KV cache"

        return {"success": True, "message": await asyncio.to_thread(_rel)}

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"], dependencies=ctl)
    async def resume_memory_occupation(body: P.MemoryOccupationReqInput | None = None):
        body = body or P.MemoryOccupationReqInput()
        if not (runner.released and body.released("weights")):
            sched.wake()  # KV buffers are reallocated on the next admission
            return {"success": True, "message": "weights not released" if not runner.released else "kv_cache resumed"}

        def _res() -> int:
            with sched.model_lock:
                runner.resume()
                moved = 0
                for path in filter(None, [engine.model_path, engine.last_disk_path]):
                    moved += W.load_into_model(runner, W.read_disk(runner, path))
            sched.wake()  # the loop idles while weights are released
            return moved

        moved = await asyncio.to_thread(_res)
        return {"success": True, "message": f"restored {moved} bytes from {engine.model_path} "
                f"then {engine.last_disk_path}; weights pushed since then must be synced again",
                "weight_version": sched.weight_version}

    add_openai_routes(app, engine)
    return app


def _check_request_size(body: P.GenerateReqInput, limits: EngineLimits) -> None:
    """Refuse a request over ``--max-request-samples`` before a job is built for any of its samples."""
    cap = limits.max_request_samples
    if not cap:
        return
    total = 0
    for i in range(body.batch_size):
        total += body.item(i)[2].n
        if total > cap:
            raise RequestTooLarge(f"over {cap} samples in one request (prompts x n; --max-request-samples); "
                                  "send smaller requests")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mrl engine", description="Embedded SGLang-protocol engine (PyTorch)")
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--token-env", help="environment variable holding the control token")
    g.add_argument("--token", help="control token (prefer --token-env: argv is visible to other users)")
    ap.add_argument("--api-key-env", help="environment variable holding an API key every route but /health* then "
                    "requires (SGLang's --api-key; an OpenAI-compatible server for other clients, e.g. a judge)")
    ap.add_argument("--max-running", type=int, default=MAX_RUNNING, help="max sequences decoded together")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0, help="seed of draws for requests without sampling_seed")
    ap.add_argument("--enable-return-routed-experts", action="store_true",
                    help="MoE models: capture the routers' top-k expert ids so /generate can return them "
                         "(return_routed_experts, SGLang's flag)")
    ap.add_argument("--log-level", default="warning")
    d = EngineLimits()
    ap.add_argument("--max-request-samples", type=int, default=d.max_request_samples,
                    help="samples (prompts x n) one request may ask for; more: HTTP 400 (0 = no limit)")
    ap.add_argument("--max-queued-samples", type=int, default=d.max_queued_samples,
                    help="samples queued or running at once; a request past it: HTTP 503 (0 = no limit)")
    ap.add_argument("--max-queued-tokens", type=int, default=d.max_queued_tokens,
                    help="prompt + max_new_tokens of every queued or running sample; past it: HTTP 503 (0 = no limit)")
    ap.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                    help="tokens of one prompt; more: HTTP 400 (0 = the model's context)")
    args = ap.parse_args(argv)
    for name in ("max_request_samples", "max_queued_samples", "max_queued_tokens", "max_prompt_tokens"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0 (0 = no limit)")
    return args


def resolve_token(args: argparse.Namespace) -> str | None:
    token = args.token
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise SystemExit(f"--token-env {args.token_env}: that environment variable is empty or unset")
    if not is_loopback(args.host) and not token:
        raise SystemExit(
            f"--host {args.host} is not loopback: refusing to serve control endpoints without a token; "
            "pass --token-env VAR (or bind 127.0.0.1)"
        )
    return token


def resolve_api_key(args: argparse.Namespace) -> str | None:
    if not args.api_key_env:
        return None
    key = os.environ.get(args.api_key_env)
    if not key:
        raise SystemExit(f"--api-key-env {args.api_key_env}: that environment variable is empty or unset")
    return key


def exit_with_parent(poll_s: float = 2.0) -> None:
    """When ``PARENT_PID_ENV`` (``MRL_ENGINE_PARENT_PID``) names the process that launched this server (``EngineProcess``
    sets it), exit as soon as that process is gone: the server runs in a session of its own, so a
    launcher killed without stopping it (a Ray actor killed at teardown) would otherwise leave it
    serving, holding its port, forever."""
    want = os.environ.get(PARENT_PID_ENV)
    if not want:
        return

    def watch() -> None:
        while os.getppid() == int(want):
            time.sleep(poll_s)
        print(f"mrl engine: launcher (pid {want}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(3)

    import threading

    threading.Thread(target=watch, name="mrl-engine-parent-watch", daemon=True).start()


def cli_main(argv: list[str] | None = None) -> int:
    """Entry of ``mrl engine``; blocks serving until interrupted."""
    import uvicorn

    args = parse_args(argv)
    token = resolve_token(args)
    exit_with_parent()
    limits = EngineLimits(args.max_request_samples, args.max_queued_samples, args.max_queued_tokens,
                          args.max_prompt_tokens)
    try:
        engine = Engine(args.model, device=args.device, dtype=args.dtype, max_running=args.max_running, seed=args.seed,
                        enable_return_routed_experts=args.enable_return_routed_experts, limits=limits)
    except ValueError as e:  # e.g. the flag on a dense model: a user mistake, no traceback
        raise SystemExit(f"mrl engine: {e}") from None
    app = build_app(engine, token=token, api_key=resolve_api_key(args))
    # SIGTERM: open requests get SHUTDOWN_GRACE_S, then are cancelled (uvicorn's default waits for every
    # connection: a long /generate kept the engine up past SIGTERM, until SIGKILL)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
