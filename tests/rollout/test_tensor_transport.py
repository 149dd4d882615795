"""The CPU ``tensor`` weight-sync transport against a real embedded engine over HTTP: the engine ends
up with the sent values, one shared-memory segment serves every sync (written in place, not
reallocated: fresh multi-MB buffers cost a page fault per 4 KiB on our hosts) and ``close`` removes it."""
from __future__ import annotations

import glob
import os

import torch
from safetensors.torch import load_file

from mrl.rollout.engine.checksum import tensor_checksum
from mrl.rollout.weight_sync.sender import WeightSyncer
from tests.helpers.tiny_models import make_tiny_hf
from tests.rollout.clients.served import serve


def _segments() -> list[str]:
    return sorted(glob.glob(f"/dev/shm/mrl_ws_{os.getpid()}_*"))


def test_tensor_transport_reuses_one_segment_and_removes_it(tmp_path):
    src = load_file(str(make_tiny_hf(tmp_path / "b", "qwen2", seed=1) / "model.safetensors"))
    with serve(tmp_path) as (url, engine):
        syncer = WeightSyncer("tensor", [url], barrier=lambda: None)
        try:
            seen = []
            for version, scale in ((1, 1.0), (2, 0.5), (3, 2.0)):
                named = [(n, t * scale) for n, t in src.items()]
                rep = syncer.sync(iter(named), version)
                assert rep.weight_version == str(version) and rep.num_buckets == 1
                got = {n: tensor_checksum(p) for n, p in engine.runner.named_weights().items() if n in src}
                assert got == {n: tensor_checksum(t) for n, t in named}
                seen.append(_segments())
            assert len(seen[0]) == 1 and seen[0] == seen[1] == seen[2]  # one segment, written in place
        finally:
            syncer.close()
        assert _segments() == []


def test_engine_reads_a_tensor_at_an_unaligned_offset(tmp_path):
    """Another sender may pack tensors without aligning their offsets: the engine copies such a one out."""
    from multiprocessing import shared_memory

    import httpx

    with serve(tmp_path) as (url, engine):
        name, p = next((n, p) for n, p in engine.runner.named_weights().items() if p.dim() == 2)
        new = torch.randn_like(p)
        raw = new.contiguous().view(torch.uint8).reshape(-1)
        shm = shared_memory.SharedMemory(create=True, size=raw.numel() + 2)
        try:
            shm.buf[2: 2 + raw.numel()] = raw.numpy().tobytes()
            spec = {"name": name, "shm_name": shm.name, "dtype": "float32", "shape": list(p.shape), "offset": 2}
            c = httpx.Client(base_url=url, trust_env=False, timeout=60)
            assert c.post("/begin_weight_update", json={}).json()["success"]
            r = c.post("/update_weights_from_tensor", json={"shm_tensors": [spec]}).json()
            assert r["success"], r
            assert c.post("/end_weight_update", json={}).json()["success"]
            assert torch.equal(engine.runner.named_weights()[name].detach(), new)
        finally:
            shm.close()
            shm.unlink()
