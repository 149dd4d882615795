"""A TP2×PP2 Megatron actor (4 gloo ranks) pushes its weights into 2 embedded engines over each
transport in turn (distributed, tensor (CPU shared memory), disk): after every sync both engines
hold exactly the actor's HF export (per-tensor checksums), report the new weight_version, and
greedy generations follow the new weights."""
from __future__ import annotations

import glob
import os

import httpx
import pytest

from mrl.rollout.sglang_launcher import (
    EngineProcess,
    build_embedded_command,
    wait_for_health,
)
from tests.helpers.dist import free_port, run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

ROUNDS = [(1, "distributed"), (2, "tensor"), (3, "disk")]
PROMPT = [3, 17, 42, 99, 7]


def _rank(rank: int, world: int, hf_dir: str, urls: list[str], work: str) -> list[dict]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config
    from mrl.rollout.engine.checksum import tensor_checksum
    from mrl.rollout.weight_sync import WeightSyncer

    init_parallel(device="cpu", tp=2, pp=2)
    # The engines start while the ranks import Megatron; wait for them here (saves ~30 s of CI).
    for u in urls:
        wait_for_health(u, timeout_s=240)
    before = _greedy(urls[0]) if rank == 0 else None
    cfg = load_hf_config(hf_dir)
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, cfg, HFCheckpointReader(hf_dir).get)
    stage, source = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank() == 0
    out = []
    for version, transport in ROUNDS:
        with torch.no_grad():  # a stand-in for an optimizer step: the same change on every rank
            for c in chunks:
                for p in c.parameters():
                    p.mul_(1.0 + 0.05 * version).add_(0.01)
        syncer = WeightSyncer(transport, urls, bucket_mb=0.05, verify=True, stage=stage, is_source=source,
                              is_coordinator=rank == 0, disk_dir=f"{work}/disk")
        rep = syncer.sync(export_hf_weights(chunks, cfg), version)
        syncer.close()
        mine = {n: tensor_checksum(t) for n, t in export_hf_weights(chunks, cfg)}
        engine = {}
        if source:
            for u in urls:
                body = httpx.post(u + "/weights_checksum", json={"names": list(mine)}, timeout=60, trust_env=False).json()
                engine[u] = body
        out.append({"before": before, "stage": stage, "source": source, "mine": mine, "engine": engine, "report": rep.metrics(),
                    "version": rep.weight_version, "bytes": rep.bytes, "buckets": rep.num_buckets, "pid": os.getpid()})
        dist.barrier()
    return out


def _greedy(url: str) -> list[int]:
    r = httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}, timeout=120, trust_env=False)
    r.raise_for_status()
    return r.json()["output_ids"]


def test_tp2_pp2_actor_pushes_weights_over_every_transport(tmp_path):
    hf = make_tiny_hf(tmp_path / "m", "qwen2")  # tied embeddings + qkv bias
    procs = []
    for i in range(2):
        port = free_port()
        p = EngineProcess(build_embedded_command(str(hf), port), f"http://127.0.0.1:{port}", tmp_path / f"e{i}.log",
                          startup_timeout_s=180)
        p.start(wait=False)
        procs.append(p)
    try:
        urls = [p.url for p in procs]
        results = run_ranks(_rank, 4, args=(str(hf), urls, str(tmp_path / "work")), timeout_s=480)
        before = results[0][0]["before"]
        all_names = set(httpx.post(urls[0] + "/weights_checksum", json={}, timeout=60, trust_env=False).json()["checksums"])
        for k, (version, transport) in enumerate(ROUNDS):
            per_rank = [r[k] for r in results]
            sources = [r for r in per_rank if r["source"]]
            assert sorted(r["stage"] for r in sources) == [0, 1]
            # TP ranks of a stage export the same full tensors
            for r in per_rank:
                twin = next(s for s in sources if s["stage"] == r["stage"])
                assert r["mine"] == twin["mine"]
            names = set(sources[0]["mine"]) | set(sources[1]["mine"])
            assert not set(sources[0]["mine"]) & set(sources[1]["mine"])
            # tied embeddings: the actor sends model.embed_tokens.weight only; the engine lists
            # its lm_head.weight too, which must carry the same values.
            assert names == all_names - {"lm_head.weight"}, (transport, names ^ all_names)
            print(transport, [(s["stage"], s["bytes"], s["buckets"], round(s["report"]["timing_s/weight_sync"], 3))
                              for s in sources])
            for s in sources:
                for u in urls:
                    assert s["engine"][u]["checksums"] == s["mine"], (transport, u)
                    assert s["engine"][u]["weight_version"] == str(version)
                assert s["version"] == str(version) and s["buckets"] > 1
                assert s["bytes"] > 0 and s["report"]["timing_s/weight_sync"] > 0
        # tied embeddings: after the last sync the engine's lm_head equals the embedding sent
        tied = httpx.post(urls[1] + "/weights_checksum", json={"names": ["lm_head.weight"]},
                          timeout=60, trust_env=False).json()["checksums"]["lm_head.weight"]
        assert results[0][-1]["stage"] == 0  # rank 0 holds the first stage (tp-cp-ep-dp-pp order)
        assert tied == results[0][-1]["mine"]["model.embed_tokens.weight"]
        # the tensor transport unlinked its segments (named after the sender's pid: another test's run may be live)
        pids = {r[0]["pid"] for r in results}
        assert not [f for f in glob.glob("/dev/shm/mrl_ws_*") if int(f.split("_")[2]) in pids]
        after = [_greedy(u) for u in urls]
        assert after[0] == after[1] != before
    finally:
        for p in procs:
            p.stop()
