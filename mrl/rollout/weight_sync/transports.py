"""The three ways a stage's HF-named tensors reach the engines (``rollout.weight_sync.transport``).

Each transport consumes ``Bucket``s of one pipeline stage on that stage's source rank and makes
the engines load them under ``weight_version``. Bytes moved = sum over tensors of
numel * itemsize, counted once per bucket (a broadcast or a shared segment serves all engines).
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import torch

from mrl.net import free_port
from mrl.rollout.weight_sync.buckets import Bucket
from mrl.rollout.weight_sync.group import destroy_group, init_custom_process_group
from mrl.rollout.weight_sync.http import EngineHttp, wait_all


def group_init_payloads(engine_world_sizes: Sequence[int], master_address: str, master_port: int, group_name: str,
                        backend: str) -> list[dict[str, Any]]:
    """The ``/init_weights_update_group`` body of each engine: the group's world is this source (rank 0) plus
    every engine's tp ranks; engine ``i``'s ranks start at ``1 + Σ_{j<i} tp_j``. SGLang ranks each of its TP ranks
    ``rank_offset + tp_rank`` with the engine-global tp rank, so an engine over several nodes needs nothing
    more: its node-rank ``r`` holds tp ranks ``[r·tp/nnodes, (r+1)·tp/nnodes)`` (tests/rollout/conformance/
    test_launch_and_pins.py runs SGLang's own code for both)."""
    world, offset, out = 1 + sum(engine_world_sizes), 1, []
    for ws in engine_world_sizes:
        out.append({"master_address": master_address, "master_port": master_port, "rank_offset": offset,
                    "world_size": world, "group_name": group_name, "backend": backend})
        offset += ws
    return out


class DistributedTransport:
    """One process group per pipeline stage: this stage's source rank (group rank 0) + every
    engine rank (engine i's tp ranks at ``rank_offset_i + tp_rank``). Per bucket: POST
    ``/update_weights_from_distributed`` {names, dtypes, shapes, group_name,
    load_format: "flattened_bucket", weight_version} to all engines and, concurrently, broadcast
    the bucket's flat uint8 vector from group rank 0."""

    def __init__(self, http: EngineHttp, stage: int, engine_world_sizes: Sequence[int], *,
                 master_address: str = "127.0.0.1", backend: str | None = None, timeout_s: float = 600.0) -> None:
        self.http = http
        self.group_name = f"mrl_weight_sync_pp{stage}"
        self.engine_world_sizes = list(engine_world_sizes)
        self.master_address = master_address
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.timeout_s = timeout_s
        self.pg = None

    def init(self) -> None:
        world = 1 + sum(self.engine_world_sizes)
        port = free_port(self.master_address)
        futs = []
        for url, payload in zip(self.http.urls, group_init_payloads(self.engine_world_sizes, self.master_address, port,
                                                                    self.group_name, self.backend)):
            futs += self.http.submit_all("/init_weights_update_group", payload, urls=[url])
        try:
            self.pg = init_custom_process_group(self.backend, self.master_address, port, 0, world,
                                                self.group_name, self.timeout_s)
        finally:
            wait_all(futs)

    def rejoin(self) -> None:
        """Form the group again after an engine restarted (its new process is no member): every
        engine leaves the old group (the restarted one never joined: its refusal is expected), this
        rank leaves it, then ``init`` forms a fresh group with every engine."""
        if self.pg is not None:
            for url in self.http.urls:
                try:
                    self.http.call(url, "/destroy_weights_update_group", {"group_name": self.group_name})
                except Exception:  # noqa: BLE001, S112 - the restarted engine has no such group
                    continue
            destroy_group(self.pg)
            self.pg = None
        self.init()

    def send(self, bucket: Bucket, version: str) -> None:
        if self.pg is None:
            raise RuntimeError("DistributedTransport.send before init(); call WeightSyncer.init() once after the engines are up")
        payload = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes, "group_name": self.group_name,
                       "load_format": "flattened_bucket", "weight_version": version, "flush_cache": False}
        futs = self.http.submit_all("/update_weights_from_distributed", payload)
        try:
            flat = bucket.flatten()
            if self.backend == "nccl":
                flat = flat.cuda()
            torch.distributed.broadcast(flat, group_src=0, group=self.pg)
        finally:
            wait_all(futs)

    def finish(self, version: str) -> None:
        pass

    def close(self) -> None:
        if self.pg is not None:
            try:  # best effort: engines keep serving even if they keep the group
                self.http.call_all("/destroy_weights_update_group", {"group_name": self.group_name})
            except Exception:  # noqa: BLE001, S110 - an older SGLang has no such endpoint
                pass
            destroy_group(self.pg)
            self.pg = None


def sglang_serializer() -> Callable[[list[tuple[str, torch.Tensor]]], str]:
    """SGLang's own serializer with its torch reductions patched in (CUDA tensors travel as IPC
    handles naming the device by UUID, which is what SGLang's receiver maps; plain ordinals differ
    between the trainer's and the engine's CUDA_VISIBLE_DEVICES). Needs SGLang in the trainer's
    environment, as it is in the image."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError as e:
        raise RuntimeError("rollout.weight_sync.transport=tensor with SGLang engines (CUDA IPC) needs SGLang importable on "
                           f"the trainer ranks ({e}); fix: install mrl[gpu] there (the docker image has it) or use "
                           "transport=distributed") from e
    monkey_patch_torch_reductions()
    return lambda named: MultiprocessingSerializer.serialize(named, output_str=True)


def cuda_ipc_payloads(named: list[tuple[str, torch.Tensor]], engine_tp_size: int,
                      serialize: Callable[[list[tuple[str, torch.Tensor]]], str]) -> list[str]:
    """``serialized_named_tensors`` for one engine: one serialization *per engine tp rank* (SGLang's
    ``deserialize_own_rank`` reads entry ``tp_rank``, and each deserialization takes its own
    reference on the producer's CUDA IPC handles, so ranks must not share one blob)."""
    return [serialize(named) for _ in range(engine_tp_size)]


class TensorTransport:
    """Colocated engines on the same host. CPU: each bucket is written into a POSIX shared memory
    segment and ``/update_weights_from_tensor`` gets ``shm_tensors`` [{name, shm_name, dtype, shape,
    offset}] (mrl's JSON form for the embedded engine; nothing is pickled). The segment is kept from
    one bucket and sync to the next (a bigger bucket replaces it) and unlinked by ``close``: the
    engines have answered before it is written again, and writing into pages already mapped avoids
    a page fault per 4 KiB of a fresh buffer (docs/performance.md, 'Shared memory kept mapped').
    GPU (SGLang): CUDA IPC handles in ``serialized_named_tensors`` (SGLang's serializer, base64), one
    entry per engine tp rank; the
    payload is checked against SGLang's schema and deserializer on CPU, the IPC itself needs GPUs."""

    def __init__(self, http: EngineHttp, engine_world_sizes: Sequence[int], use_cuda_ipc: bool | None = None) -> None:
        self.http = http
        self.engine_world_sizes = list(engine_world_sizes)
        self.use_cuda_ipc = torch.cuda.is_available() if use_cuda_ipc is None else use_cuda_ipc
        self._seq = 0
        self._shm: shared_memory.SharedMemory | None = None

    def init(self) -> None:
        pass

    @staticmethod
    def remove_segments(pids: list[int]) -> list[str]:
        """Unlink the segments senders with these process ids left (processes killed before their close,
        e.g. a rank SIGKILLed and its peers killed at teardown); the names they had."""
        gone = []
        for f in Path("/dev/shm").glob("mrl_ws_*"):  # POSIX shared memory on Linux (SharedMemory's home)
            parts = f.name.split("_")
            if len(parts) > 2 and parts[2].isdigit() and int(parts[2]) in pids:
                f.unlink(missing_ok=True)
                gone.append(f.name)
        return gone

    def _segment(self, nbytes: int) -> shared_memory.SharedMemory:
        if self._shm is None or self._shm.size < nbytes:
            self._release()
            self._seq += 1
            name = f"mrl_ws_{os.getpid()}_{self._seq}_{secrets.token_hex(4)}"
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, nbytes))
        return self._shm

    def _release(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def send(self, bucket: Bucket, version: str) -> None:
        if self.use_cuda_ipc:
            return self._send_cuda_ipc(bucket, version)
        shm = self._segment(bucket.nbytes)
        flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=bucket.nbytes) if bucket.nbytes else None
        entries, off = [], 0
        for n, t, dt, shp in zip(bucket.names, bucket.tensors, bucket.dtypes, bucket.shapes):
            nb = t.numel() * t.element_size()
            if nb:
                flat[off: off + nb].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))  # type: ignore[index]
            entries.append({"name": n, "shm_name": shm.name, "dtype": dt, "shape": shp, "offset": off})
            off += nb
        del flat  # no view of the segment may outlive this call (close() would refuse)
        payload = {"shm_tensors": entries, "weight_version": version, "flush_cache": False}
        self.http.call_all("/update_weights_from_tensor", payload)

    def _send_cuda_ipc(self, bucket: Bucket, version: str) -> None:
        named = [(n, t.detach().cuda().contiguous()) for n, t in zip(bucket.names, bucket.tensors)]
        serialize = sglang_serializer()
        futs = []
        for url, ws in zip(self.http.urls, self.engine_world_sizes):
            payload: dict[str, Any] = {"serialized_named_tensors": cuda_ipc_payloads(named, ws, serialize),
                                       "weight_version": version, "flush_cache": False}
            futs += self.http.submit_all("/update_weights_from_tensor", payload, urls=[url])
        wait_all(futs)

    def finish(self, version: str) -> None:
        pass

    def close(self) -> None:
        self._release()


def write_bucket_file(directory: Path, stage: int, index: int, bucket: Bucket) -> int:
    """One safetensors shard per bucket: ``model-pp{stage}-{index}.safetensors``; returns bytes."""
    from safetensors.torch import save_file

    # clone: safetensors refuses tensors sharing storage (tied or sliced exports).
    tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in zip(bucket.names, bucket.tensors)}
    save_file(tensors, str(directory / f"model-pp{stage:02d}-{index:05d}.safetensors"), metadata={"format": "pt"})
    return bucket.nbytes


class DiskTransport:
    """Every stage source writes its buckets as safetensors shards into ``directory`` (shared by
    the trainer and the engines); once all stages are written the coordinator calls
    ``/update_weights_from_disk`` {model_path: directory, weight_version} on every engine."""

    def __init__(self, http: EngineHttp, directory: str | os.PathLike, stage: int) -> None:
        self.http = http
        self.dir = Path(directory)
        self.stage = stage
        self._index = 0

    def init(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def clear(self) -> None:
        """Coordinator, before any stage writes: old shards would otherwise be loaded too."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in [*self.dir.glob("model-pp*.safetensors"), self.dir / "mrl_weight_version.txt"]:
            p.unlink(missing_ok=True)

    def send(self, bucket: Bucket, version: str) -> None:
        write_bucket_file(self.dir, self.stage, self._index, bucket)
        self._index += 1

    def finish(self, version: str) -> None:
        self._index = 0

    def mark_version(self, version: str) -> None:
        """Written last (coordinator, after every stage wrote): ``disk_resync`` reads it."""
        (self.dir / "mrl_weight_version.txt").write_text(version)

    def load_on_engines(self, version: str, urls: Sequence[str] | None = None) -> None:
        self.mark_version(version)
        self.http.call_all("/update_weights_from_disk",
                           {"model_path": str(self.dir), "weight_version": version, "flush_cache": True}, urls=urls)

    def close(self) -> None:
        pass
