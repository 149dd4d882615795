"""The other direction: a trainer that uses SGLang's own helpers (as verl and slime do) pushes weights
into our embedded engine (``python -m mrl.rollout.engine.server``): SGLang's ``init_custom_process_group``
as rank 0 and SGLang's ``FlattenedTensorBucket`` packing, our engine as rank 1."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from mrl.rollout.engine.checksum import tensor_checksum
from tests.helpers.dist import free_port
from tests.helpers.serving import wait_http_ok
from tests.helpers.sglang_real import require
from tests.helpers.tiny_models import make_tiny_hf

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(300)
def test_sglang_helpers_push_into_the_embedded_engine(tmp_path):
    require()
    import torch.distributed as dist
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    d = make_tiny_hf(tmp_path / "m", "llama")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mrl.rollout.engine.server", "--model", str(d), "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url, proc)
        new = {n: t + 0.01 for n, t in load_file(str(d / "model.safetensors")).items()}
        mport, box = free_port(), {}
        join = threading.Thread(target=lambda: box.update(init=httpx.post(url + "/init_weights_update_group", timeout=120, json={
            "master_address": "127.0.0.1", "master_port": mport, "rank_offset": 1, "world_size": 2,
            "group_name": "sgl_sender", "backend": "gloo"}).json()))
        join.start()
        pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{mport}", world_size=2, rank=0,
                                       group_name="sgl_sender")
        join.join(timeout=120)
        assert box["init"]["success"], box
        assert httpx.post(url + "/begin_weight_update", json={}, timeout=30).status_code == 200
        bucket = FlattenedTensorBucket(named_tensors=list(new.items()))
        meta = bucket.get_metadata()
        body = {"names": [m.name for m in meta], "dtypes": [str(m.dtype).removeprefix("torch.") for m in meta],
                "shapes": [list(m.shape) for m in meta], "group_name": "sgl_sender", "load_format": "flattened_bucket",
                "weight_version": "7", "flush_cache": True}
        upd = threading.Thread(target=lambda: box.update(upd=httpx.post(
            url + "/update_weights_from_distributed", json=body, timeout=120).json()))
        upd.start()
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        upd.join(timeout=120)
        assert box["upd"]["success"], box
        assert httpx.post(url + "/end_weight_update", json={}, timeout=30).status_code == 200
        got = httpx.post(url + "/weights_checksum", json={"names": list(new)}, timeout=60).json()
        assert got["checksums"] == {n: tensor_checksum(t) for n, t in new.items()} and got["weight_version"] == "7"
        dist.destroy_process_group(pg)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
