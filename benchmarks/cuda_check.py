"""CUDA checks of mrl's GPU paths on one GPU (not a test: CI has no GPU): `python benchmarks/cuda_check.py`.

A: the embedded engine on CUDA (fp32 and bf16): sampled log-probs vs a transformers forward on CUDA.
B: the Megatron actor on CUDA (one rank, NCCL): compute_log_prob vs transformers, fp32 and bf16, then one
   on-policy update step (bf16: Megatron mixed precision with fp32 main params)."""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.getcwd())
OUT = os.environ.get("OUT", "/tmp")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
PROMPT = [5, 17, 33, 101, 7, 9]


def hf_model(path, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def engine_check(path):
    from fastapi.testclient import TestClient

    from mrl.rollout.engine.server import Engine, build_app
    out = {}
    for dt in ("float32", "bfloat16"):
        eng = Engine(str(path), device="cuda", dtype=dt)
        t0 = time.time()
        with TestClient(build_app(eng)) as c:
            body = {"input_ids": [PROMPT] * 8, "return_logprob": True,
                    "sampling_params": [{"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": k, "ignore_eos": True}
                                        for k in range(8)]}
            r = c.post("/generate", json=body).json()
        wall = time.time() - t0
        m = hf_model(path, getattr(torch, dt))
        worst = 0.0
        for s in r:
            ids = s["output_ids"]
            lps = [e[0] for e in s["meta_info"]["output_token_logprobs"]]
            x = torch.tensor([PROMPT + ids], device="cuda")
            with torch.no_grad():
                ref = torch.log_softmax(m(input_ids=x).logits.float()[0, len(PROMPT) - 1:-1], -1)
            ref = ref.gather(1, torch.tensor(ids, device="cuda")[:, None])[:, 0].cpu()
            worst = max(worst, float((ref - torch.tensor(lps)).abs().max()))
        out[dt] = {"max_abs_logprob_diff_vs_transformers": worst, "samples": len(r),
                   "tokens": sum(len(s["output_ids"]) for s in r), "wall_s": round(wall, 2),
                   "distinct_samples": len({tuple(s["output_ids"]) for s in r}), "decode_path": eng.runner.decode_path}
    return out


def actor_check(path, dtype_name):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import ragged_batch
    dt = getattr(torch, dtype_name)
    batch = ragged_batch(with_rollout=True)
    cfg = ActorConfig(ppo_micro_batch_size_per_gpu=4, optim={"lr": 1e-2, "clip_grad": 1.0})
    t0 = time.time()
    actor = ActorWorker(cfg, model_path=str(path), device="cuda", mini_batch_size_samples=8, seed=1234, dtype=dt)
    build_s = time.time() - t0
    lp, _ent = actor.compute_log_prob(batch)
    P = batch.input_ids.shape[1] - batch.responses.shape[1]
    m = hf_model(path, dt)
    with torch.no_grad():
        logits = m(input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda(),
                   position_ids=batch.position_ids.cuda()).logits.float()
    ref = torch.log_softmax(logits[:, P - 1:-1], -1).gather(2, batch.responses.cuda()[..., None])[..., 0].cpu()
    mask = batch.response_mask.bool()
    diff = float((ref - lp.float().cpu())[mask].abs().max())
    t1 = time.time()
    metrics, lp2, _ = actor.update_policy_on_policy(batch.replace(old_log_probs=None))
    upd_s = time.time() - t1
    after, _ = actor.compute_log_prob(batch)
    moved = float((after.float().cpu() - lp.float().cpu())[mask].abs().max())
    p = next(iter(actor.engine.chunks[0].parameters()))
    extra = {}
    try:  # the colocated reference (swaps weights in and out of the actor's params) and repr embeddings
        from mrl.workers.reference import ColocatedReference
        ref = ColocatedReference(actor)
        rlp = ref.compute_ref_log_prob(batch)
        extra["ref_equals_current_policy_max_abs"] = float((rlp.float().cpu() - after.float().cpu())[mask].abs().max())
    except Exception as e:  # noqa: BLE001
        extra["ref_error"] = repr(e)[-800:]
    try:  # the reward model worker vs transformers' Qwen2ForSequenceClassification on CUDA
        import transformers as tf

        from mrl.workers.reward_model import RewardModelWorker
        from tests.workers.test_reward_model import make_tiny_rm
        rp = make_tiny_rm(pathlib.Path(tempfile.mkdtemp()) / "rm", "qwen2")
        from mrl.config.parallel import ParallelConfig
        w = RewardModelWorker(rp, ParallelConfig(), micro_batch_size=3, seed=1234, device="cuda", dtype=dt,
                              init_parallel=False)
        got = w.compute_rm_score(batch).float().cpu()
        rm = tf.AutoModelForSequenceClassification.from_pretrained(rp, dtype=dt).cuda().eval()
        am = batch.attention_mask.bool()
        with torch.no_grad():
            one = torch.stack([rm(input_ids=batch.input_ids[i][am[i]][None].cuda()).logits[0, 0].float().cpu()
                               for i in range(batch.batch_size)])
        extra["rm_max_abs_score_diff_vs_transformers"] = float((got - one).abs().max())
        extra["rm_score_std"] = float(one.std())
    except Exception:  # noqa: BLE001
        import traceback
        extra["rm_error"] = traceback.format_exc()[-1500:]
    return {**extra, "dtype": dtype_name, "param_dtype": str(p.dtype), "param_device": str(p.device),
            "max_abs_logprob_diff_vs_transformers": diff, "shortcut_logprobs_equal_compute_log_prob":
            float((lp2.float().cpu() - lp.float().cpu())[mask].abs().max()),
            "update_metrics": {k: float(v) for k, v in metrics.items() if k.startswith("actor/")},
            "policy_moved_max_abs": moved, "build_s": round(build_s, 2), "update_s": round(upd_s, 3),
            "gpu": torch.cuda.get_device_name(0)}


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "actor":
        print(json.dumps(actor_check(sys.argv[2], sys.argv[3])))
        sys.exit(0)
    from tests.helpers.tiny_models import make_tiny_hf
    path = make_tiny_hf(pathlib.Path(tempfile.mkdtemp()) / "m", "qwen2")
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    try:
        report["engine"] = engine_check(path)
    except Exception:  # noqa: BLE001
        import traceback
        report["engine_error"] = traceback.format_exc()[-3000:]
    for dt in ("float32", "bfloat16"):
        p = subprocess.run([sys.executable, __file__, "actor", str(path), dt], check=False, capture_output=True,
                           text=True, timeout=240)
        try:
            report[f"actor_{dt}"] = json.loads(p.stdout.strip().splitlines()[-1])
        except Exception:  # noqa: BLE001
            report[f"actor_{dt}_error"] = (p.stdout[-1500:] + "\n" + p.stderr[-3000:])
    txt = json.dumps(report, indent=1)
    print(txt)
    pathlib.Path(OUT, "cuda_check.json").write_text(txt)
