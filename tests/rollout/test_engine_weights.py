"""Weight updates by HF name into the embedded engine: disk, shared memory, torch.distributed
(per-tensor and flattened bucket). Each must change generations, bump weight_version and make
the engine's checksums equal the source tensors'."""
from __future__ import annotations

import time

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from mrl.rollout.engine.checksum import tensor_checksum
from mrl.rollout.engine.server import Engine, build_app
from tests.helpers.dist import free_port, run_ranks
from tests.helpers.shm import tensors_to_shm
from tests.helpers.tiny_models import make_tiny_hf

PROMPT = [5, 17, 33, 101, 7, 9]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("w")
    return make_tiny_hf(root / "a", "qwen2", seed=0), make_tiny_hf(root / "b", "qwen2", seed=1)


def _source(dir_b) -> dict[str, torch.Tensor]:
    return load_file(str(dir_b / "model.safetensors"))


def _greedy(c) -> list[int]:
    return c.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}).json()["output_ids"]


def _checksums(c, names) -> dict[str, str]:
    return c.post("/weights_checksum", json={"names": names}).json()["checksums"]


def _reference_greedy(dirs) -> tuple[list[int], list[int]]:
    out = []
    for d in dirs:
        with TestClient(build_app(Engine(str(d)))) as c:
            out.append(_greedy(c))
    assert out[0] != out[1]
    return out[0], out[1]


@pytest.fixture(scope="module")
def greedy_ab(dirs):
    return _reference_greedy(dirs)


def test_update_from_disk(dirs, greedy_ab):
    a, b = dirs
    src = _source(b)
    with TestClient(build_app(Engine(str(a)))) as c:
        assert _greedy(c) == greedy_ab[0]
        r = c.post("/update_weights_from_disk", json={"model_path": str(b)}).json()
        assert r["success"] and r["weight_version"] == "1"
        assert _greedy(c) == greedy_ab[1]
        assert _checksums(c, list(src)) == {n: tensor_checksum(t) for n, t in src.items()}
        gen = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}).json()
        assert gen["meta_info"]["weight_version"] == "1"
        r = c.post("/update_weights_from_disk", json={"model_path": str(a), "weight_version": "step-7"}).json()
        assert r["weight_version"] == "step-7" and _greedy(c) == greedy_ab[0]
        bad = c.post("/update_weights_from_disk", json={"model_path": str(a / "nope")})
        assert bad.status_code == 400 and "nope" in bad.json()["message"]


def test_update_from_tensor_shm(dirs, greedy_ab):
    a, b = dirs
    src = _source(b)
    # The sender side: one segment holding every tensor back to back (a flat bucket in shm).
    shm, specs = tensors_to_shm(src)
    try:
        with TestClient(build_app(Engine(str(a)))) as c:
            assert c.post("/begin_weight_update", json={}).json()["success"]
            refused = c.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["gASVAAAA"]})
            assert refused.status_code == 400 and "shm_tensors" in refused.json()["error"]["message"]
            traversal = c.post("/update_weights_from_tensor", json={"shm_tensors": [{**specs[0], "shm_name": "../etc/passwd"}]})
            assert traversal.status_code == 422
            r = c.post("/update_weights_from_tensor", json={"shm_tensors": specs, "weight_version": "v2"}).json()
            assert r["success"] and r["weight_version"] == "v2"
            assert _greedy(c) == greedy_ab[1]
            assert _checksums(c, list(src)) == {n: tensor_checksum(t) for n, t in src.items()}
            short = c.post("/update_weights_from_tensor", json={"shm_tensors": [{**specs[-1], "offset": sum(t.numel() * t.element_size() for t in src.values())}]})
            assert short.status_code == 400 and specs[-1]["name"] in short.json()["message"]
    finally:
        shm.close()
        shm.unlink()


def _post_into(client, path, body, box) -> None:
    box["r"] = client.post(path, json=body).json()


def _dist_rank(rank, world_size, port, a, b, served):
    """rank 0: the trainer-side sender; rank 1: an engine (in-process app) receiving. Two updates
    over one group: b per tensor (load_format null), then a as one flattened bucket. The first
    broadcast waits until the engine has answered a /generate while its update waited (the file
    ``served``): a handshake, not a time, so a loaded host cannot make the update finish first."""
    import threading

    import torch.distributed as dist

    from mrl.rollout.weight_sync.group import init_custom_process_group

    srcs = [load_file(str(d / "model.safetensors")) for d in (b, a)]
    formats = [None, "flattened_bucket"]
    if rank == 0:
        pg = init_custom_process_group("gloo", "127.0.0.1", port, 0, 2, "weight_update_group", timeout_s=60)
        for i, (src, fmt) in enumerate(zip(srcs, formats)):
            if i == 0:  # hold the first broadcast: the engine must keep serving meanwhile
                deadline = time.monotonic() + 120
                while not served.exists():
                    assert time.monotonic() < deadline, "the engine answered no /generate while its update waited"
                    time.sleep(0.05)
            if fmt == "flattened_bucket":
                flat = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in src.values()])
                dist.broadcast(flat, group=pg, group_src=0)
            else:
                for t in src.values():
                    dist.broadcast(t.contiguous(), group=pg, group_src=0)
        return [{n: tensor_checksum(t) for n, t in src.items()} for src in srcs]
    out = []
    with TestClient(build_app(Engine(str(a)))) as c:
        greedy = [_greedy(c)]
        r = c.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo"}).json()
        assert r["success"], r
        assert c.post("/begin_weight_update", json={}).json()["success"]
        for src, fmt in zip(srcs, formats):
            names = list(src)
            body = {"names": names, "dtypes": ["float32"] * len(names),
                    "shapes": [list(src[n].shape) for n in names], "load_format": fmt}
            box: dict = {}
            # The request blocks on the broadcast in a worker thread; the event loop keeps serving.
            t = threading.Thread(target=_post_into, args=(c, "/update_weights_from_distributed", body, box))
            t.start()
            time.sleep(0.5)  # the update request reaches the app (if it did not, "served" would prove nothing)
            served_meanwhile = _greedy(c) == greedy[0] and "r" not in box
            served.touch()
            t.join(timeout=60)
            out.append({"resp": box["r"], "served_meanwhile": served_meanwhile, "greedy": _greedy(c),
                        "checksums": _checksums(c, names)})
        assert c.post("/end_weight_update", json={}).json()["success"]
        destroyed = c.post("/destroy_weights_update_group", json={}).json()["success"]
    return {"before": greedy[0], "updates": out, "destroyed": destroyed}


@pytest.mark.multirank
def test_update_from_distributed_per_tensor_and_flattened_bucket(dirs, greedy_ab, tmp_path):
    a, b = dirs
    served = tmp_path / "served"
    sender, engine = run_ranks(_dist_rank, 2, args=(free_port(), a, b, served), timeout_s=150, init_process_group=False)
    assert engine["before"] == greedy_ab[0]
    first, second = engine["updates"]
    assert first["resp"]["success"] and first["resp"]["weight_version"] == "1"
    assert first["served_meanwhile"]  # /generate answered while the update waited on its broadcast
    assert first["greedy"] == greedy_ab[1] and first["checksums"] == sender[0]
    assert second["resp"]["success"] and second["resp"]["weight_version"] == "2"
    assert second["greedy"] == greedy_ab[0] and second["checksums"] == sender[1]
    assert engine["destroyed"]


def test_release_and_resume(dirs, greedy_ab):
    a, _ = dirs
    engine = Engine(str(a))
    with TestClient(build_app(engine)) as c:
        assert _greedy(c) == greedy_ab[0]  # allocates the KV buffers
        kv_bytes = engine.scheduler._rb.nbytes
        assert kv_bytes > 0
        r = c.post("/release_memory_occupation", json={}).json()
        assert r["success"] and all(p.numel() == 0 for p in engine.runner.model.parameters())
        assert f"{kv_bytes} bytes of KV cache" in r["message"] and engine.scheduler._rb.nbytes == 0
        assert c.post("/generate", json={"input_ids": PROMPT}).status_code == 503
        assert c.post("/resume_memory_occupation", json={}).json()["success"]
        assert _greedy(c) == greedy_ab[0]
