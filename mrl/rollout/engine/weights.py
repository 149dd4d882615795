"""Weight updates by HF name: from a safetensors directory, from POSIX shared memory, and from
broadcasts of a torch.distributed group whose rank 0 is the trainer.

Every path first *receives* without touching the model (fresh tensors for disk and broadcasts, so
generation goes on while a broadcast is in flight; views of the sender's segment for shared
memory, which the sender leaves unchanged until the update is answered), then validates
names/shapes against the model and copies under the scheduler's ``model_lock`` (between two
decode steps). A name the model does not have,
or a shape that differs, fails the whole update before anything is copied.
"""
from __future__ import annotations

import datetime
import mmap
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from mrl.rollout.engine.model_runner import ModelRunner, list_safetensors, parse_dtype
from mrl.rollout.protocol import ShmTensor, UpdateWeightsFromDistributedReqInput

SHM_DIR = "/dev/shm"


def check_named(runner: ModelRunner, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Validate every (name, tensor) against the model's HF names and shapes."""
    meta = runner.weight_meta()
    out = []
    for name, t in named:
        if name not in meta:
            sample = sorted(meta)[:6]
            raise KeyError(f"weight {name!r} is not a parameter of the engine's model (HF names, e.g. {sample})")
        shape = meta[name][1]
        if tuple(t.shape) != shape:
            raise ValueError(f"weight {name!r}: shape {list(t.shape)} sent, model has {list(shape)}")
        out.append((name, t))
    return out


def load_into_model(runner: ModelRunner, named: list[tuple[str, torch.Tensor]]) -> int:
    """Copy validated tensors into the model (casting to the model dtype). Caller holds the lock.
    Returns bytes copied."""
    params = runner.named_weights()
    moved = 0
    with torch.no_grad():
        for name, t in named:
            p = params[name]
            p.data.copy_(t.to(device=p.device, dtype=p.dtype))
            moved += t.numel() * t.element_size()
    return moved


# ---- disk ------------------------------------------------------------------------------------
def read_disk(runner: ModelRunner, model_path: str) -> list[tuple[str, torch.Tensor]]:
    """All tensors of ``model_path/*.safetensors`` (no pickle involved)."""
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model_path {model_path!r} is not a directory; pass the dir holding *.safetensors")
    named: list[tuple[str, torch.Tensor]] = []
    for f in list_safetensors(model_path):
        named.extend(load_file(f, device="cpu").items())
    return check_named(runner, named)


# ---- shared memory ---------------------------------------------------------------------------
def read_shm(runner: ModelRunner, specs: list[ShmTensor]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor as a view of ``/dev/shm/<shm_name>`` at ``offset``, copied into the model by the
    caller. The segments belong to the sender, which leaves them unchanged until this update has been
    answered; we map them privately (copy-on-write), so nothing we do reaches the sender and no
    resource tracker is involved. A view, not a read into a fresh buffer: fresh buffers of a few MB
    cost a page fault per 4 KiB (docs/performance.md, 'Shared memory kept mapped')."""
    maps: dict[str, tuple[mmap.mmap | None, int]] = {}
    named = []
    for s in specs:
        dtype = parse_dtype(s.dtype)
        numel = 1
        for d in s.shape:
            numel *= int(d)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = numel * itemsize
        if s.shm_name not in maps:
            path = os.path.join(SHM_DIR, s.shm_name)
            try:
                with open(path, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    maps[s.shm_name] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None, size)
            except OSError as e:
                raise FileNotFoundError(f"shm_tensors[{s.name!r}]: shared-memory segment {s.shm_name!r} not found ({e})") from e
        mm, size = maps[s.shm_name]
        if s.offset < 0 or s.offset + nbytes > size:
            raise ValueError(
                f"shm_tensors[{s.name!r}]: needs bytes [{s.offset}, {s.offset + nbytes}) but segment "
                f"{s.shm_name!r} has {size}"
            )
        if not nbytes:
            named.append((s.name, torch.empty(s.shape, dtype=dtype)))
            continue
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=s.offset)
        if s.offset % itemsize:
            raw = raw.clone()  # a dtype view needs an aligned start (our sender aligns; another may not)
        named.append((s.name, raw.view(dtype).reshape(s.shape)))
    return check_named(runner, named)


# ---- torch.distributed -----------------------------------------------------------------------
class DistGroups:
    """Weight-update groups this engine has joined, by ``group_name``.

    Formed like SGLang's engine side (TCP rendezvous at master_address:master_port, c10d's group
    helper with ``group_name`` as store prefix) via ``mrl.rollout.weight_sync.group``, so the
    trainer's sender joins the same group with the same helper. This engine is one rank:
    ``rank_offset`` of ``world_size`` (rank 0 is the sender)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: dict[str, dist.ProcessGroup] = {}

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str, timeout_s: float = 300.0) -> None:
        from mrl.rollout.weight_sync.group import init_custom_process_group

        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists; destroy it first or use another group_name")
        if backend == "nccl" and self.device.type != "cuda":
            backend = "gloo"  # SGLang's default is nccl; a CPU engine can only speak gloo
        self.groups[group_name] = init_custom_process_group(
            backend, master_address, master_port, rank_offset, world_size, group_name, timeout_s=timeout_s,
        )

    def destroy(self, group_name: str) -> None:
        from mrl.rollout.weight_sync.group import destroy_group

        pg = self.groups.pop(group_name, None)
        if pg is None:
            raise KeyError(f"no weight update group {group_name!r}; known: {sorted(self.groups)}")
        destroy_group(pg)

    def receive(self, runner: ModelRunner, req: UpdateWeightsFromDistributedReqInput) -> list[tuple[str, torch.Tensor]]:
        """Blocking: receive the broadcasts rank 0 sends for ``req`` (run off the event loop).

        load_format None: one broadcast per tensor, in ``names`` order, each in its own dtype.
        load_format "flattened_bucket": one broadcast of uint8 [sum_i numel_i * itemsize_i], the
        tensors' bytes concatenated in ``names`` order, sliced back here."""
        pg = self.groups.get(req.group_name)
        if pg is None:
            raise KeyError(
                f"no weight update group {req.group_name!r}; call /init_weights_update_group first (known: {sorted(self.groups)})"
            )
        dtypes = [parse_dtype(d) for d in req.dtypes]
        empties = [torch.empty(s, dtype=d, device=self.device) for s, d in zip(req.shapes, dtypes)]
        # Validate before receiving so a bad request fails fast... but the sender broadcasts
        # anyway, so we still drain the broadcasts to keep the group usable.
        error: Exception | None = None
        try:
            check_named(runner, zip(req.names, empties))
        except (KeyError, ValueError) as e:
            error = e
        if req.load_format == "flattened_bucket":
            sizes = [t.numel() * t.element_size() for t in empties]
            off = 0
            for name, t, n in zip(req.names, empties, sizes):
                if off % t.element_size() and error is None:  # SGLang's FlattenedTensorBucket refuses it too
                    error = ValueError(f"Unaligned received tensor {name}: byte offset {off}, dtype {t.dtype}")
                off += n
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            pg.broadcast([flat], _bcast_opts()).wait()
            out, off = [], 0
            for t, n in zip(empties, sizes):
                out.append(flat[off:off + n].view(t.dtype).reshape(t.shape))
                off += n
        elif req.load_format in (None, "", "auto"):
            for t in empties:
                pg.broadcast([t], _bcast_opts()).wait()
            out = empties
        else:
            raise ValueError(f"load_format {req.load_format!r} is not supported; use null or 'flattened_bucket'")
        if error is not None:
            raise error
        return list(zip(req.names, out))


def _bcast_opts() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=600)
    return opts
