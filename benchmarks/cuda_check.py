"""CUDA checks of mrl's GPU code paths on ONE GPU, in single processes without Ray (not a test: CI has no GPU).

    python benchmarks/cuda_check.py                      # fp32 and bf16, every check; exit 1 on any FAIL
    python benchmarks/cuda_check.py --dtypes float32 --no-probe --json /tmp/cuda_check.json
    python benchmarks/cuda_check.py --dtypes bfloat16 --only attention    # sdpa + packed rows (varlen_attn), seconds
    python benchmarks/cuda_check.py --dtypes float32,bfloat16 --only families  # MoE families' actors vs transformers

Prints a PASS/FAIL/SKIP/INFO table with the measured numbers (and writes it as JSON to --json, default
$OUT/cuda_check.json when $OUT is set). Without a visible CUDA device it says so and exits 0 with nothing
checked (``--allow-cpu`` runs the same checks on CPU/gloo, to develop the script on a CPU host).

Per dtype, one process (torch.distributed NCCL, world size 1; Megatron's local layer spec, no Transformer
Engine) on a tiny Qwen2 (tests/helpers/tiny_models.py) runs, in order:
  engine      the built-in engine (mrl/rollout/engine) generating on CUDA; its sampled log-probs vs a
              transformers forward on CUDA
  actor       MegatronModel/ActorWorker built on CUDA from the HF checkpoint; HF->Megatron load exact
              (the Megatron->HF export equals the checkpoint's tensors); compute_log_prob vs transformers;
              the trainer's log-probs of the engine's samples vs the engine's (verl's rollout_probs_diff)
  update      one update_policy (Megatron optimizer on CUDA): finite loss and grad norm, weights move,
              optimizer state on the GPU (fp32 main params under bf16)
  reference   the colocated reference (pinned host copy swapped in) = the pre-update policy, exactly
  export      actor.export_hf -> transformers.from_pretrained on CUDA = the trained actor
  sync        the trained weights into the engine: weight sync ``tensor`` (shared memory, as the driver
              builds it for the built-in engine), ``disk``, and the in-process copy of CUDA tensors; after
              each, checksums verified and the engine's log-probs = the trainer's
  release     /release_memory_occupation and /resume_memory_occupation on the engine
  offload     actor.offload()/onload() on CUDA: device memory freed, bitwise the same policy, update after
  checkpoint  Megatron dist-checkpoint save/load on CUDA
  critic / rm / lora   the critic, the reward model (vs Qwen2ForSequenceClassification) and a LoRA actor
  attention   megatron.attention_backend=sdpa (mrl's SDPA core attention): one forward+backward, its log-probs and
              gradients vs the local backend's (Megatron's unfused attention); packed rows
              (actor.use_remove_padding: one row of whole sequences, on CUDA in bf16 through
              torch.nn.attention.varlen.varlen_attn, whose calls are counted) vs padded rows: log-probs (max |diff|)
              and gradients (relative L2 difference); ``--only attention`` runs just this block (seconds)
  families    ``--only families`` (not in the default run): each MoE family's tiny checkpoint (Qwen3-MoE, DeepSeek-V3
              with MLA/YaRN/group-limited sigmoid routing, GLM-4.5, gpt-oss with sinks and windows) as the actor on
              the device vs transformers on the device, padded and packed rows, and one forward+backward
Then two single-purpose processes: the engine's memory release at a ~40M-parameter size (device-visible
free memory, what a colocated trainer in another process could use), and a probe of two NCCL ranks in two
processes on the one GPU (the shape of a colocated engine + trainer rank in one weight-sync group).
Tolerances (max |difference| of log-probs): fp32 1e-4 with TF32 off; bf16 0.1 (reward scores: 1e-4 / 0.25;
gradients of two attention paths, |g1 - g2| / |g2|: fp32 1e-4, bf16 0.05).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = [[5, 17, 33, 101, 7, 9], [44, 12], [250, 3, 77, 8, 19, 120, 64, 31, 90], [11, 22, 33]]
N_PER_PROMPT = 4
TOL_LP = {"float32": 1e-4, "bfloat16": 0.1}
TOL_RM = {"float32": 1e-4, "bfloat16": 0.25}
TOL_GRAD = {"float32": 1e-4, "bfloat16": 0.05}  # |g1 - g2| / |g2| of the accumulated gradients of two attention paths


# ---- result rows -----------------------------------------------------------------------------------
class Checks:
    """Rows of (check, status, measured, limit, detail); a failing block becomes a FAIL row, not a crash."""

    def __init__(self, tag: str, path: str | None = None) -> None:
        self.tag, self.rows, self.path = tag, [], path

    def _push(self, row: dict) -> None:
        self.rows.append(row)
        if self.path:  # written after every row: a worker that dies in CUDA code keeps what it had
            pathlib.Path(self.path).write_text(json.dumps(self.rows))

    def add(self, name: str, ok: bool, value=None, limit=None, detail: str = "") -> bool:
        self._push({"tag": self.tag, "check": name, "status": "PASS" if ok else "FAIL", "value": value,
                          "limit": limit, "detail": detail})
        return ok

    def info(self, name: str, detail: str, value=None) -> None:
        self._push({"tag": self.tag, "check": name, "status": "INFO", "value": value, "limit": None,
                          "detail": detail})

    def skip(self, name: str, why: str) -> None:
        self._push({"tag": self.tag, "check": name, "status": "SKIP", "value": None, "limit": None,
                          "detail": why})

    @contextlib.contextmanager
    def guard(self, name: str):
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every failure is a row; the next block still runs
            tb = traceback.format_exc().strip().splitlines()
            self._push({"tag": self.tag, "check": name, "status": "FAIL", "value": None, "limit": None,
                              "detail": f"{type(e).__name__}: {str(e)[:600]} | at {' / '.join(tb[-5:-1])[-700:]}"})


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "0" if v == 0 else (f"{v:.3g}" if abs(v) >= 1e-3 else f"{v:.2e}")
    return str(v)


def print_table(rows: list[dict]) -> None:
    w = max([len(f"{r['tag']}: {r['check']}") for r in rows] + [10])
    print(f"\n{'check'.ljust(w)}  status  {'measured':>10}  {'limit':>9}  detail")
    print("-" * (w + 60))
    for r in rows:
        print(f"{(r['tag'] + ': ' + r['check']).ljust(w)}  {r['status']:<6}  {fmt(r['value']):>10}  "
              f"{fmt(r['limit']):>9}  {r['detail']}")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "SKIP", "INFO")}
    print("-" * (w + 60))
    print("  ".join(f"{k} {v}" for k, v in counts.items()))


# ---- helpers shared by the workers --------------------------------------------------------------------
def maxdiff(a, b, mask=None) -> float:
    d = (a.float().cpu() - b.float().cpu()).abs()
    if mask is not None:
        d = d[mask.bool().cpu()]
    return float(d.max()) if d.numel() else 0.0


def samples_batch(prompts, outputs):
    """TrainBatch of (prompt, response) pairs: prompts left-padded to P, responses right-padded to R."""
    import torch

    from mrl.workers.batch import TrainBatch
    P, R, B = max(map(len, prompts)), max(map(len, outputs)), len(prompts)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    am = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(o)] = torch.tensor(o)
        am[i, P - len(p):P + len(o)] = 1
    pos = (am.cumsum(-1) - 1).clamp(min=0) * am
    return TrainBatch(input_ids=ids, attention_mask=am, position_ids=pos, responses=ids[:, P:].clone(),
                      response_mask=am[:, P:].clone(), uid=torch.arange(B) // N_PER_PROMPT)


def hf_batch_log_probs(model, batch, device):
    """[B, R] log-probs of the batch's responses under a transformers model (padded forward)."""
    import torch
    P = batch.input_ids.shape[1] - batch.responses.shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                       position_ids=batch.position_ids.to(device)).logits.float()
    lp = torch.log_softmax(logits[:, P - 1:-1], -1).gather(2, batch.responses.to(device)[..., None])[..., 0]
    return lp.cpu() * batch.response_mask


def serve(engine):
    """The engine's FastAPI app on a free loopback port from a thread (as InProcessEngine serves it)."""
    import threading

    import uvicorn

    from mrl.net import free_port
    from mrl.rollout.engine.server import build_app
    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not server.started:
        if time.monotonic() - t0 > 60 or not th.is_alive():
            raise RuntimeError("engine HTTP server did not start")
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}", server


def generate(url, prompts, max_new, seed0=0, n=N_PER_PROMPT):
    """n samples per prompt (ragged lengths via max_new_tokens); returns (prompts, outputs, engine log-probs,
    their TrainBatch)."""
    import httpx
    ps = [p for p in prompts for _ in range(n)]
    sp = [{"max_new_tokens": max_new - (i % 3) * (max_new // 4), "temperature": 1.0, "sampling_seed": seed0 + i,
           "ignore_eos": True} for i in range(len(ps))]
    r = httpx.post(f"{url}/generate", json={"input_ids": ps, "return_logprob": True, "sampling_params": sp},
                   timeout=300, trust_env=False)
    r.raise_for_status()
    out = r.json()
    outs = [s["output_ids"] for s in out]
    lps = [[e[0] for e in s["meta_info"]["output_token_logprobs"]] for s in out]
    return ps, outs, lps, samples_batch(ps, outs)


def padded(lps, R):
    import torch
    t = torch.zeros(len(lps), R)
    for i, row in enumerate(lps):
        t[i, :len(row)] = torch.tensor(row)
    return t


# ---- worker: everything of one dtype in one process (NCCL world 1) -------------------------------------
def trainer_worker(a) -> list[dict]:
    import torch
    import torch.distributed as dist
    import transformers as tf
    from safetensors.torch import load_file

    dt, dev = a.dtype, a.device
    tdt = getattr(torch, dt)
    tol, C, S = TOL_LP[dt], Checks(dt, a.result), {}
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    model = a.model
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"cuda_check_{dt}_"))
    is_cuda = dev == "cuda"

    def hf(path, cls=tf.AutoModelForCausalLM):
        return cls.from_pretrained(path, dtype=tdt).to(dev).eval()

    # -- engine ------------------------------------------------------------------------------------
    with C.guard("engine: generate + log-probs vs transformers"):
        from mrl.rollout.engine.server import Engine
        eng = Engine(model, device=dev, dtype=dt, seed=0)
        url, server = serve(eng)
        S["eng"], S["url"], S["server"] = eng, url, server
        t0 = time.perf_counter()
        ps, outs, elps, b = generate(url, PROMPTS, 24)
        wall = time.perf_counter() - t0
        S["gen"] = (ps, outs, elps, b)
        e_lp = padded(elps, b.response_length)
        ref = hf_batch_log_probs(hf(model), b, dev)
        d = maxdiff(ref, e_lp, b.response_mask)
        p = next(eng.runner.model.parameters())
        C.add("engine: generate + log-probs vs transformers", d <= tol, d, tol,
              f"{len(outs)} samples, {sum(map(len, outs))} tokens in {wall:.2f}s, params {p.device}/{p.dtype}, "
              f"decode path {eng.runner.decode_path}, {len({tuple(o) for o in outs})} distinct")

    # -- actor ---------------------------------------------------------------------------------------
    with C.guard("actor: build on device (Megatron, NCCL world 1)"):
        from mrl.config.actor import ActorConfig
        from mrl.workers.actor import ActorWorker
        cfg = ActorConfig(ppo_micro_batch_size_per_gpu=4, optim={"lr": 1e-3, "clip_grad": 1.0})
        t0 = time.perf_counter()
        actor = ActorWorker(cfg, model_path=model, device=dev, mini_batch_size_samples=8, seed=1234, dtype=tdt)
        S["actor"] = actor
        p = next(iter(actor.model.chunks[0].parameters()))
        opt = actor.optimizer
        kinds = [type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])]
        ok = p.device.type == dev and p.dtype == tdt and dist.get_world_size() == 1
        C.add("actor: build on device (Megatron, NCCL world 1)", ok, round(time.perf_counter() - t0, 2), None,
              f"backend {dist.get_backend()}, params {p.device}/{p.dtype}, optimizer {kinds}, qkv layer "
              f"{next(type(m).__name__ for n, m in actor.model.chunks[0].named_modules() if n.endswith('linear_qkv'))}")

    if "actor" in S:
        actor = S["actor"]
        with C.guard("actor: HF->Megatron load = checkpoint (via Megatron->HF export)"):
            exp = {n: t.detach().clone() for n, t in actor.export_hf_weights()}
            S["w0"] = exp
            src = load_file(str(pathlib.Path(model) / "model.safetensors"))
            common = sorted(set(exp) & set(src))
            d = max(maxdiff(exp[n], src[n].to(tdt)) for n in common)
            missing = sorted(set(src) - set(exp))
            devs = {str(t.device) for t in exp.values()}
            C.add("actor: HF->Megatron load = checkpoint (via Megatron->HF export)", d == 0 and not missing, d, 0.0,
                  f"{len(common)} tensors exact after cast to {dt}; exported on {devs}; missing {missing[:3]}")

        with C.guard("actor: compute_log_prob vs transformers"):
            from tests.workers.batches import ragged_batch
            rb = ragged_batch()
            lp, ent = actor.compute_log_prob(rb)
            d = maxdiff(hf_batch_log_probs(hf(model), rb, dev), lp, rb.response_mask)
            C.add("actor: compute_log_prob vs transformers", d <= tol and bool(torch.isfinite(ent).all()), d, tol,
                  f"ragged batch {tuple(rb.input_ids.shape)}")

        if "gen" in S:
            with C.guard("actor vs engine: log-probs of the engine's samples"):
                ps, outs, elps, b = S["gen"]
                lp0, _ = actor.compute_log_prob(b)
                S["lp0"] = lp0
                d = maxdiff(lp0, padded(elps, b.response_length), b.response_mask)
                C.add("actor vs engine: log-probs of the engine's samples", d <= tol, d, tol,
                      f"{int(b.response_mask.sum())} sampled tokens (verl's training/rollout_probs_diff_max)")

        with C.guard("reference: colocated snapshot built"):
            from mrl.workers.reference import ColocatedReference
            S["ref"] = ColocatedReference(actor)
            pinned = all(h.is_pinned() for h in S["ref"].host) if is_cuda else None
            C.add("reference: colocated snapshot built", pinned is not False, None, None,
                  f"host copy pinned: {pinned}")

        with C.guard("update: one update_policy step (Megatron optimizer)"):
            ps, outs, elps, b = S["gen"]
            g = torch.Generator().manual_seed(0)
            ub = b.replace(old_log_probs=S["lp0"], advantages=torch.randn(b.responses.shape, generator=g) * b.response_mask)
            t0 = time.perf_counter()
            m = actor.update_policy(ub)
            if is_cuda:
                torch.cuda.synchronize()
            ms = time.perf_counter() - t0
            w1 = {n: t.detach().clone() for n, t in actor.export_hf_weights()}
            moved = max(maxdiff(w1[n], S["w0"][n]) for n in w1)
            changed = sum(maxdiff(w1[n], S["w0"][n]) > 0 for n in w1)
            inner = [getattr(o, "optimizer", o) for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
            st_dev = {str(v.device) for o in inner for s in o.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
            main = {str(p.dtype) for o in inner for gr in o.param_groups for p in gr["params"]}
            finite = all(math.isfinite(v) for v in m.values())
            gn = m.get("actor/grad_norm", float("nan"))
            lp1, _ = actor.compute_log_prob(b)
            S["lp1"] = lp1
            pol = maxdiff(lp1, S["lp0"], b.response_mask)
            ok = finite and gn > 0 and changed == len(w1) and (not is_cuda or st_dev == {"cuda:0"}) and pol > 0 \
                and main == {"torch.float32"}
            C.add("update: one update_policy step (Megatron optimizer)", ok, pol, None,
                  f"pg_loss {m.get('actor/pg_loss', float('nan')):.4g}, grad_norm {gn:.4g}, {changed}/{len(w1)} tensors "
                  f"moved (max {moved:.3g}), Adam state on {sorted(st_dev)}, main params {sorted(main)}, "
                  f"{ms * 1e3:.0f} ms; measured = max |log-prob change|")

        if "ref" in S and "lp1" in S:
            with C.guard("reference: = pre-update policy, actor restored"):
                ps, outs, elps, b = S["gen"]
                rlp = S["ref"].compute_ref_log_prob(b)
                lp1b, _ = actor.compute_log_prob(b)
                d1, d2 = maxdiff(rlp, S["lp0"], b.response_mask), maxdiff(lp1b, S["lp1"], b.response_mask)
                C.add("reference: = pre-update policy, actor restored", d1 == 0 and d2 == 0, max(d1, d2), 0.0,
                      f"|ref - pre-update| {d1:.3g}, |actor after ref - actor| {d2:.3g}")

        with C.guard("export: export_hf -> transformers = trained actor"):
            ps, outs, elps, b = S["gen"]
            out = tmp / "export"
            actor.export_hf(out)
            files = load_file(str(next(out.glob("*.safetensors"))))
            w1 = {n: t for n, t in actor.export_hf_weights()}
            dx = max(maxdiff(files[n], w1[n]) for n in w1 if n in files)
            m2 = hf(out)
            d = maxdiff(hf_batch_log_probs(m2, b, dev), S["lp1"], b.response_mask)
            C.add("export: export_hf -> transformers = trained actor", d <= tol and dx == 0, d, tol,
                  f"files = export_hf_weights exactly: {dx == 0}; {len(files)} tensors")
            del m2

        # -- weights into the engine -------------------------------------------------------------------
        if "eng" in S and "lp1" in S:
            from mrl.rollout.engine import weights as W
            from mrl.rollout.engine.checksum import tensor_checksum
            from mrl.rollout.weight_sync import WeightSyncer
            eng, url = S["eng"], S["url"]

            def reset_engine():  # the checkpoint's weights, and no weight-update window left open by a failed sync
                import httpx
                httpx.post(f"{url}/end_weight_update", json={}, timeout=30, trust_env=False)  # 400 when none is open
                with eng.scheduler.model_lock:
                    W.load_into_model(eng.runner, W.read_disk(eng.runner, model))

            def engine_matches_trainer(seed0):
                _, _, elps, b = generate(url, PROMPTS, 16, seed0=seed0)
                lp, _ = actor.compute_log_prob(b)
                return maxdiff(lp, padded(elps, b.response_length), b.response_mask)

            def engine_sums():
                params = eng.runner.named_weights()
                return {n: tensor_checksum(params[n]) for n in S["w0"]}

            sent = {n: tensor_checksum(t) for n, t in actor.export_hf_weights()}
            C.skip("sync: tensor transport over CUDA IPC", "SGLang's receiver only (not installed); the built-in "
                   "engine refuses pickled tensors, so the driver builds the tensor transport with cuda_ipc=False for it")
            for name, transport, kw in (
                    ("sync: tensor transport (shared memory, as the driver builds it for rollout.engine=torch)", "tensor",
                     {"cuda_ipc": False}),
                    ("sync: disk transport", "disk", {"disk_dir": str(tmp / "wsync")})):
                with C.guard(name):
                    reset_engine()
                    syncer = WeightSyncer(transport, [url], verify=True, barrier=lambda: None, **kw)
                    try:
                        t0 = time.perf_counter()
                        rep = syncer.sync(actor.export_hf_weights(), version=str(len(C.rows)))
                        s_ms = (time.perf_counter() - t0) * 1e3
                    finally:
                        syncer.close()
                    same = engine_sums() == sent
                    d = engine_matches_trainer(100)
                    C.add(name, rep.verified and same and d <= tol, d, tol,
                          f"verified {rep.verified}, {rep.num_tensors} tensors / {rep.bytes} B in {s_ms:.0f} ms; "
                          "measured = engine vs trainer log-probs after the sync")

            with C.guard("sync: in-process copy of the trainer's device tensors"):
                import types

                from mrl.rollout.engine.in_process import InProcessEngine
                reset_engine()
                named = list(actor.export_hf_weights())
                src_dev = {str(t.device) for _, t in named}
                fake = types.SimpleNamespace(engine=eng, url=url)
                nbytes, nt = InProcessEngine.load_weights(fake, named, "99", verify=True, timeout_s=60)
                d = engine_matches_trainer(200)
                C.add("sync: in-process copy of the trainer's device tensors", engine_sums() == sent and d <= tol, d, tol,
                      f"{nt} tensors / {nbytes} B from {sorted(src_dev)}; checksums equal")

            with C.guard("engine: release + resume memory occupation"):
                import httpx
                cli = httpx.Client(timeout=120, trust_env=False)
                wbytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
                a0 = torch.cuda.memory_allocated() if is_cuda else 0
                r = cli.post(f"{url}/release_memory_occupation", json={}).json()
                a1 = torch.cuda.memory_allocated() if is_cuda else 0
                r2 = cli.post(f"{url}/resume_memory_occupation", json={}).json()
                _, _, elps, b = generate(url, PROMPTS, 16, seed0=300)
                lp, _ = actor.compute_log_prob(b)  # resume reloads model.path, then the last disk sync (= the actor)
                d = maxdiff(lp, padded(elps, b.response_length), b.response_mask)
                freed = a0 - a1
                ok = r.get("success") and r2.get("success") and d <= tol and (not is_cuda or freed >= 0.9 * wbytes)
                C.add("engine: release + resume memory occupation", bool(ok), d, tol,
                      f"allocated fell by {freed} B (weights {wbytes} B); resumed from model.path + the last disk "
                      "sync: measured = engine vs trainer")
                cli.close()

        # -- offload --------------------------------------------------------------------------------
        with C.guard("offload: actor offload/onload on device"):
            ps, outs, elps, b = S["gen"]
            lp_a, _ = actor.compute_log_prob(b)
            m0 = torch.cuda.memory_allocated() if is_cuda else 0
            actor.offload(force=not is_cuda)
            host = sum(h.numel() for _, h in actor._offloaded.entries) if actor._offloaded else 0
            m1 = torch.cuda.memory_allocated() if is_cuda else 0
            actor.onload()
            m2 = torch.cuda.memory_allocated() if is_cuda else 0
            lp_b, _ = actor.compute_log_prob(b)
            d = maxdiff(lp_a, lp_b, b.response_mask)
            g = torch.Generator().manual_seed(1)
            mm = actor.update_policy(b.replace(old_log_probs=lp_b, advantages=torch.randn(b.responses.shape, generator=g)
                                               * b.response_mask))
            fin = all(math.isfinite(v) for v in mm.values())
            ok = d == 0 and fin and host > 0 and (not is_cuda or (m0 - m1 >= 0.95 * host and m2 == m0))
            C.add("offload: actor offload/onload on device", ok, d, 0.0,
                  f"{host} B to host, allocated {m0} -> {m1} -> {m2} B; update after onload finite: {fin}")

        with C.guard("checkpoint: dist-checkpoint save/load"):
            ps, outs, elps, b = S["gen"]
            ck = tmp / "ckpt"
            lp_s, _ = actor.compute_log_prob(b)
            actor.save_checkpoint(ck, ["model", "optimizer", "extra"])
            g = torch.Generator().manual_seed(2)
            actor.update_policy(b.replace(old_log_probs=lp_s, advantages=torch.randn(b.responses.shape, generator=g)
                                          * b.response_mask))
            lp_m, _ = actor.compute_log_prob(b)
            actor.load_checkpoint(ck, ["model", "optimizer", "extra"])
            lp_l, _ = actor.compute_log_prob(b)
            d = maxdiff(lp_l, lp_s, b.response_mask)
            C.add("checkpoint: dist-checkpoint save/load", d == 0 and maxdiff(lp_m, lp_s, b.response_mask) > 0, d, 0.0,
                  "log-probs after load = at save (an update in between moved them)")

    # -- critic, reward model, LoRA (same process, parallel state already set) --------------------------
    if "actor" in S:
        ps, outs, elps, b = S["gen"]
        with C.guard("critic: values + one update"):
            from mrl.config.critic import CriticConfig
            from mrl.workers.critic import CriticWorker
            critic = CriticWorker(CriticConfig(ppo_micro_batch_size_per_gpu=4, optim={"lr": 1e-3}), model_path=model,
                                  device=dev, mini_batch_size_samples=8, seed=1234, dtype=tdt, init_parallel=False)
            v0 = critic.compute_values(b)
            g = torch.Generator().manual_seed(3)
            m = critic.update_critic(b.replace(values=v0, returns=(v0 + torch.randn(v0.shape, generator=g)) * b.response_mask))
            v1 = critic.compute_values(b)
            mv = maxdiff(v1, v0, b.response_mask)
            fin = all(math.isfinite(v) for v in m.values()) and bool(torch.isfinite(v0).all())
            p = next(iter(critic.model.chunks[0].parameters()))
            C.add("critic: values + one update", fin and mv > 0, mv, None,
                  f"vf_loss {m.get('critic/vf_loss', float('nan')):.4g}, params {p.device}/{p.dtype}; measured = "
                  "max |value change|")
            del critic

        with C.guard("reward model: scores vs Qwen2ForSequenceClassification"):
            from mrl.config.parallel import ParallelConfig
            from mrl.workers.reward_model import RewardModelWorker
            w = RewardModelWorker(a.rm, ParallelConfig(), micro_batch_size=3, seed=1234, device=dev, dtype=tdt,
                                  init_parallel=False)
            got = w.compute(b).float().cpu()
            rm = hf(a.rm, tf.AutoModelForSequenceClassification)
            am = b.attention_mask.bool()
            with torch.no_grad():
                one = torch.stack([rm(input_ids=b.input_ids[i][am[i]][None].to(dev)).logits[0, 0].float().cpu()
                                   for i in range(b.batch_size)])
            d = maxdiff(got, one)
            C.add("reward model: scores vs Qwen2ForSequenceClassification", d <= TOL_RM[dt], d, TOL_RM[dt],
                  f"score std {float(one.std()):.3g}")
            del w, rm

        with C.guard("lora: adapters on device, merged export = transformers"):
            from mrl.config.actor import ActorConfig
            from mrl.workers.actor import ActorWorker
            lcfg = ActorConfig(ppo_micro_batch_size_per_gpu=4, optim={"lr": 1e-2, "clip_grad": 1.0},
                               lora={"rank": 8, "alpha": 16})
            la = ActorWorker(lcfg, model_path=model, device=dev, mini_batch_size_samples=8, seed=1234, dtype=tdt,
                             init_parallel=False)
            l0, _ = la.compute_log_prob(b)
            base = maxdiff(l0, hf_batch_log_probs(hf(model), b, dev), b.response_mask)
            g = torch.Generator().manual_seed(4)
            la.update_policy(b.replace(old_log_probs=l0, advantages=torch.randn(b.responses.shape, generator=g) * b.response_mask))
            l1, _ = la.compute_log_prob(b)
            merged = {n: t.detach() for n, t in la.export_hf_weights()}
            hm = hf(model)
            hm.load_state_dict({n: t.to(tdt) for n, t in merged.items()}, strict=False)
            d = maxdiff(hf_batch_log_probs(hm, b, dev), l1, b.response_mask)
            mv = maxdiff(l1, l0, b.response_mask)
            C.add("lora: adapters on device, merged export = transformers", d <= tol and base <= tol and mv > 0, d, tol,
                  f"init = base model within {base:.3g}; update moved log-probs by {mv:.3g}")
            del la, hm

    if "actor" in S:
        attention_checks(C, model, dt, dev)

    if "server" in S:
        S["server"].should_exit = True
    return C.rows


# ---- attention backends: sdpa vs local, packed rows (varlen_attn on CUDA) vs padded rows ------------------------
def attention_checks(C: Checks, model: str, dt: str, dev: str) -> None:
    """Rows ``attention: ...`` (the module docstring); parallel state already initialised (world size 1)."""
    import torch

    import mrl.megatron.sdpa_attention as sdpa_mod
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import ragged_batch

    tdt, tol, gtol = getattr(torch, dt), TOL_LP[dt], TOL_GRAD[dt]
    rb = ragged_batch()  # 8 samples, ragged prompts and responses: padded rows carry padding, packed rows none
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=4, optim={"lr": 1e-3, "clip_grad": 1.0})
    calls = [0]
    real = sdpa_mod._varlen_attn

    def counting():  # SDPAAttention looks varlen_attn up per call: count the calls that reach it
        found = real()  # (varlen_attn, whether it takes enable_gqa) or None
        if found is None:
            return None
        fn, takes_gqa = found

        def varlen(*args, **kw):
            calls[0] += 1
            return fn(*args, **kw)
        return varlen, takes_gqa

    def build(backend: str, packed: bool):
        return ActorWorker(cfg, model_path=model, device=dev, mini_batch_size_samples=8, seed=1234, dtype=tdt,
                           init_parallel=False, attention_backend=backend, remove_padding=packed)

    def core(actor) -> str:
        return ",".join(sorted({type(m).__name__ for n, m in actor.model.chunks[0].named_modules()
                                if n.endswith("core_attention")}))

    def fwd_bwd(actor):
        """(loss terms, the accumulated gradient as one fp32 vector, pad fraction of the forwards)"""
        actor.model.pad_fraction()
        m = actor.forward_backward(rb)
        if dev == "cuda":
            torch.cuda.synchronize()
        g = torch.cat([p.main_grad.detach().float().flatten().cpu() for c in actor.model.chunks
                       for p in c.parameters() if p.requires_grad])
        return m, g, actor.model.pad_fraction()

    def rel(g1, g2) -> float:
        return float((g1 - g2).norm() / g2.norm().clamp_min(1e-30))

    S: dict = {}
    name = "attention: sdpa forward+backward = local backend"
    with C.guard(name):
        sa = build("sdpa", False)
        m, g, pad = fwd_bwd(sa)
        lp = sa.compute_log_prob(rb)[0]
        S.update(lp=lp, g=g, pad=pad, core=core(sa))
        del sa
        la = build("local", False)
        _, gl, _ = fwd_bwd(la)
        lpl = la.compute_log_prob(rb)[0]
        lcore = core(la)
        del la
        d, r = maxdiff(lp, lpl, rb.response_mask), rel(g, gl)
        fin = all(math.isfinite(v) for v in m.values()) and bool(torch.isfinite(g).all()) and float(g.norm()) > 0
        C.add(name, d <= tol and r <= gtol and fin and S["core"] == "SDPAAttention", d, tol,
              f"log-probs max |sdpa - local|; gradients |g_sdpa - g_local| / |g_local| = {r:.3g} (limit {gtol}); "
              f"|g| {float(g.norm()):.4g}, loss terms finite: {fin}; core attention {S['core']} vs {lcore}; "
              f"ragged batch {tuple(rb.input_ids.shape)}, {dt} on {dev}")

    name = "attention: packed rows (varlen_attn) = padded rows"
    if "lp" not in S:
        C.skip(name, "the sdpa forward+backward above failed")
        return
    with C.guard(name):
        sdpa_mod._varlen_attn = counting
        try:
            pa = build("sdpa", True)
            lpp = pa.compute_log_prob(rb)[0]
            fwd_calls = calls[0]
            _, gp, ppad = fwd_bwd(pa)
            del pa
        finally:
            sdpa_mod._varlen_attn = real
        d, r = maxdiff(lpp, S["lp"], rb.response_mask), rel(gp, S["g"])
        fused = dev == "cuda" and dt in ("bfloat16", "float16")
        have = real() is not None
        path = (f"varlen_attn called {calls[0]} times ({fwd_calls} in the log-prob forward)" if calls[0] else
                "per-sequence SDPA (varlen_attn is used on CUDA in bf16/fp16 only)" if not fused else
                "varlen_attn NOT called" + ("" if have else " (this torch has no torch.nn.attention.varlen)"))
        ok = d <= tol and r <= gtol and ppad == 0 and (calls[0] > 0 or not fused)
        C.add(name, ok, d, tol,
              f"log-probs max |packed - padded|; gradients |g_packed - g_padded| / |g_padded| = {r:.3g} (limit "
              f"{gtol}); pad fraction packed {ppad:.3g} vs padded {S['pad']:.3g}; {path}; {dt} on {dev}")


def _single_rank_worker(a, label: str, checks) -> list[dict]:
    """One ``--only`` block alone, in its own process: parallel state of world size 1 (NCCL on CUDA), TF32 off,
    then ``checks(C)``."""
    import torch

    from mrl.megatron.parallel import init_parallel
    C = Checks(a.dtype, a.result)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    with C.guard(f"{label}: parallel state (world size 1)"):
        init_parallel(device=a.device, seed=1234)
        checks(C)
    return C.rows


def attention_worker(a) -> list[dict]:
    """``--only attention``: the attention rows alone."""
    return _single_rank_worker(a, "attention", lambda C: attention_checks(C, a.model, a.dtype, a.device))


# ---- MoE families on the device: each family's tiny model through the actor vs transformers --------------------
FAMILY_CHECKS = ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")


def family_checks(C: Checks, dt: str, dev: str) -> None:
    """Rows ``family <name>: ...``: per MoE family (the registered ones of FAMILY_CHECKS), a tiny random checkpoint
    (tests/helpers) built as mrl's Megatron actor on the device (world size 1, EP1, attention_backend=sdpa): its
    log-probs of a ragged batch vs transformers' on the same device and dtype, padded and packed rows, and one
    forward+backward with finite, non-zero gradients. DeepSeek-V3 is the parity model (MLA with q_lora, YaRN,
    a dense first layer, group-limited sigmoid routing with the score-correction bias)."""
    import tempfile as _tf

    import torch
    import transformers as tf

    from mrl.config.actor import ActorConfig
    from mrl.families import FAMILIES
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import ragged_batch

    tdt, tol = getattr(torch, dt), TOL_LP[dt]
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=4, optim={"lr": 1e-3, "clip_grad": 1.0})
    root = pathlib.Path(_tf.mkdtemp(prefix="cuda_check_families_"))
    for fam in FAMILY_CHECKS:
        if fam not in FAMILIES:
            C.skip(f"family {fam}: actor vs transformers", "not a registered family in this tree")
            continue
        name = f"family {fam}: actor log-probs vs transformers (padded, packed rows) + fwd/bwd"
        with C.guard(name):
            if fam == "deepseek_v3":
                from tests.helpers.tiny_deepseek import make_tiny_deepseek_hf
                path = make_tiny_deepseek_hf(root / fam)
            else:
                from tests.helpers.tiny_models import make_tiny_hf
                # gpt-oss at the published swiglu_limit 7.0: transformers 5.17 (the device host's) hard-codes it (5.24
                # reads config.json), so the tiny model's 0.4 (tests/helpers/tiny_models.py) would compare two formulas
                path = make_tiny_hf(root / fam, fam, **({"swiglu_limit": 7.0} if fam == "gpt_oss" else {}))
            hm = tf.AutoModelForCausalLM.from_pretrained(path, dtype=tdt).to(dev).eval()
            rb = ragged_batch(vocab=int(hm.config.vocab_size))
            ref = hf_batch_log_probs(hm, rb, dev)
            del hm
            diffs, grads = {}, {}
            for packed in (False, True):
                actor = ActorWorker(cfg, model_path=str(path), device=dev, mini_batch_size_samples=8, seed=1234,
                                    dtype=tdt, init_parallel=False, attention_backend="sdpa", remove_padding=packed)
                diffs[packed] = maxdiff(actor.compute_log_prob(rb)[0], ref, rb.response_mask)
                m = actor.forward_backward(rb)
                g = torch.cat([p.main_grad.detach().float().flatten().cpu() for c in actor.model.chunks
                               for p in c.parameters() if p.requires_grad])
                grads[packed] = (all(math.isfinite(v) for v in m.values()) and bool(torch.isfinite(g).all())
                                 and float(g.norm()) > 0)
                del actor
                if dev == "cuda":
                    torch.cuda.empty_cache()
            d = max(diffs.values())
            C.add(name, d <= tol and all(grads.values()), d, tol,
                  f"max |actor - transformers| padded {diffs[False]:.3g}, packed {diffs[True]:.3g}; gradients finite "
                  f"and non-zero: {grads}; ragged batch {tuple(rb.input_ids.shape)}, {dt} on {dev}")


def families_worker(a) -> list[dict]:
    """``--only families``: the MoE family rows alone."""
    return _single_rank_worker(a, "families", lambda C: family_checks(C, a.dtype, a.device))


# ---- worker: the engine's memory release at a size where the allocator's granularity does not hide it --
def engine_memory_worker(a) -> list[dict]:
    import httpx
    import torch
    import transformers as tf

    from mrl.rollout.engine.server import Engine
    C = Checks("bfloat16", a.result)
    name = "engine: release frees device memory (~40M params)"
    if a.device != "cuda":
        C.skip(name, "needs CUDA (device-visible free memory)")
        return C.rows
    with C.guard(name):
        path = pathlib.Path(tempfile.mkdtemp()) / "mid"
        cfg = tf.Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                             tie_word_embeddings=True)
        torch.manual_seed(0)
        tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
        eng = Engine(str(path), device="cuda", dtype="bfloat16", seed=0)
        url, server = serve(eng)
        t0 = time.perf_counter()
        _, outs, _, _ = generate(url, [[5 + i, 17, 33, 101] for i in range(8)], 64, n=8)
        gen_s = time.perf_counter() - t0
        wbytes = sum(p.numel() * p.element_size() for p in eng.runner.model.parameters())
        cli = httpx.Client(timeout=120, trust_env=False)
        torch.cuda.synchronize()
        f0, r0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        rel = cli.post(f"{url}/release_memory_occupation", json={}).json()
        torch.cuda.synchronize()
        f1, r1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        torch.cuda.empty_cache()  # what the release would give with the allocator's cache returned
        f2 = torch.cuda.mem_get_info()[0]
        res = cli.post(f"{url}/resume_memory_occupation", json={}).json()
        _, outs2, _, _ = generate(url, [[5, 17, 33, 101]], 16, n=2)
        cli.close()
        server.should_exit = True
        gain = f1 - f0
        C.add(name, bool(rel.get("success") and res.get("success") and gain >= 0.8 * wbytes and outs2),
              gain / 2**20, round(0.8 * wbytes / 2**20, 1),
              f"MiB free on the device gained by the release (weights {wbytes / 2**20:.0f} MiB; reserved "
              f"{r0 / 2**20:.0f} -> {r1 / 2**20:.0f} MiB; +empty_cache: {(f2 - f0) / 2**20:.0f} MiB); "
              f"generation {sum(map(len, outs))} tokens in {gen_s:.2f}s; resume + generate ok: {bool(outs2)}")
    return C.rows


# ---- worker: two NCCL ranks on one GPU (a colocated engine and its trainer rank in one group) ----------
def nccl_probe_rank(a) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=40))
    t = torch.full((4,), float(a.rank + 1), device="cuda")
    dist.broadcast(t, src=0)
    torch.cuda.synchronize()
    print(json.dumps({"rank": a.rank, "value": float(t[0])}))
    dist.destroy_process_group()


def nccl_probe(a) -> list[dict]:
    from mrl.net import free_port
    C = Checks("-")
    name = "probe: NCCL group of 2 processes on 1 GPU"
    port = free_port("127.0.0.1")
    env = {**os.environ, "NCCL_DEBUG": "WARN"}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "nccl_rank", "--rank", str(r), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append("timed out after 60 s")
    ok = all(p.returncode == 0 for p in procs)
    lines = [ln for o in outs for ln in o.splitlines() if "Duplicate GPU" in ln or "Error" in ln or '"value"' in ln]
    C.info(name, ("broadcast worked" if ok else f"failed (rc {[p.returncode for p in procs]})") + ": "
           + " | ".join(dict.fromkeys(ln.strip()[:220] for ln in lines[:4])))
    return C.rows


# ---- orchestration ---------------------------------------------------------------------------------------
def run_worker(args: list[str], timeout: int) -> tuple[list[dict], str]:
    fd, res = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, __file__, *args, "--result", res]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        log = p.stdout + p.stderr
        rows = json.loads(pathlib.Path(res).read_text() or "[]")
        if p.returncode != 0 and not rows:
            rows = [{"tag": "-", "check": f"worker {args[1]}", "status": "FAIL", "value": None, "limit": None,
                     "detail": f"exit {p.returncode}: {log[-900:]}"}]
    except subprocess.TimeoutExpired as e:
        log = str(e.stdout or "")[-2000:]
        rows = json.loads(pathlib.Path(res).read_text() or "[]") + [
            {"tag": "-", "check": f"worker {' '.join(args[:4])}", "status": "FAIL", "value": None, "limit": None,
             "detail": f"timed out after {timeout} s"}]
    print(f"[worker {' '.join(args[:4])}: {time.perf_counter() - t0:.1f}s]", flush=True)
    return rows, log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-probe", action="store_true", help="skip the two-process NCCL probe")
    ap.add_argument("--no-memory", action="store_true", help="skip the ~40M-parameter engine memory check")
    ap.add_argument("--json", default=None, help="write the rows here (default $OUT/cuda_check.json if $OUT is set)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per worker process")
    ap.add_argument("--allow-cpu", action="store_true", help="run the checks on CPU/gloo (developing this script)")
    ap.add_argument("--verbose", action="store_true", help="print each worker's log")
    ap.add_argument("--only", choices=["attention", "families"],
                    help="run only this block (per dtype; no memory or NCCL probe)")
    # internal: worker processes
    ap.add_argument("--worker", choices=["trainer", "attention", "families", "engine_memory", "nccl_rank"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--rm", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29531, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.worker == "nccl_rank":
        nccl_probe_rank(a)
        return 0
    if a.worker:
        rows = {"trainer": trainer_worker, "attention": attention_worker, "families": families_worker,
                "engine_memory": engine_memory_worker}[
            a.worker](a)
        pathlib.Path(a.result).write_text(json.dumps(rows))
        return 0

    import torch
    if not torch.cuda.is_available() and not a.allow_cpu:
        print(f"cuda_check: SKIP - no CUDA device visible (torch {torch.__version__}, cuda {torch.version.cuda}); "
              "nothing was checked. Run it on a GPU host (--allow-cpu runs the same checks on CPU/gloo).")
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import transformers

    from mrl.net import free_port
    from tests.helpers.tiny_models import make_tiny_hf
    from tests.workers.test_reward_model import make_tiny_rm
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "python": sys.version.split()[0]}
    try:
        from importlib.metadata import version
        env["megatron-core"] = version("megatron-core")
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if device == "cuda" else None
    except Exception as e:  # noqa: BLE001
        env["versions_error"] = repr(e)
    print("cuda_check:", json.dumps(env), flush=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="cuda_check_"))
    model = str(make_tiny_hf(tmp / "tiny-qwen2", "qwen2"))
    rm = "" if a.only else str(make_tiny_rm(tmp / "tiny-rm", "qwen2"))
    rows, logs = [], {}
    for dt in [d for d in a.dtypes.split(",") if d]:
        r, logs[dt] = run_worker(["--worker", a.only or "trainer", "--dtype", dt, "--device", device, "--model", model,
                                  "--rm", rm, "--port", str(free_port("127.0.0.1"))], a.timeout)
        rows += r
    if not a.no_memory and not a.only:
        r, logs["memory"] = run_worker(["--worker", "engine_memory", "--device", device], a.timeout)
        rows += r
    if not a.no_probe and device == "cuda" and not a.only:
        rows += nccl_probe(a)
    if a.verbose:
        for k, v in logs.items():
            print(f"==== worker log {k} ====\n{v[-6000:]}")
    print_table(rows)
    out = a.json or (os.path.join(os.environ["OUT"], "cuda_check.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).write_text(json.dumps({"env": env, "rows": rows, "logs_tail": {k: v[-4000:] for k, v in
                                                                                         logs.items()}}, indent=1))
    failed = [r for r in rows if r["status"] == "FAIL"]
    print(f"cuda_check: {'FAIL' if failed else 'PASS'} on {env['device']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
