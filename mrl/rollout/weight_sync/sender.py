"""Push the actor's weights into the engine pool: one ``WeightSyncer`` per trainer rank.

Every rank of a pipeline stage iterates the same ``named_tensors`` (Megatron's
``export_hf_weights`` gathers TP shards collectively, so all TP ranks must drive it); only the
stage's *source* rank (tp/dp/cp rank 0) sends. One *coordinator* rank (global rank 0) does the
pool-wide steps. A sync follows SGLang's protocol (the pinned release; tests/rollout/conformance/
checks each call against SGLang's own code):

    coordinator: POST /pause_generation {mode: retract}    running requests go back to the queue
                                                           (skipped with pause=False, see sync)
                 POST /flush_cache, repeated while it answers 400 (SGLang refuses to flush while
                 requests run; retract makes that end within a step)
                 POST /begin_weight_update {}              distributed/tensor: SGLang >= 0.5.22
                                                           refuses updates outside this window
    barrier
    source of stage s: buckets of <= bucket_mb -> transport (distributed | tensor | disk)
    barrier
    coordinator: POST /end_weight_update {} (distributed/tensor) or
                 POST /update_weights_from_disk {model_path, weight_version} (disk); barrier
    verify (sources, embedded engine only): /weights_checksum == tensor_checksum of what was sent
    barrier;  coordinator: POST /continue_generation {}    (only after a pause)
    -> WeightSyncReport(weight_version, timing_s/weight_sync, bytes, ...)

``weight_version`` is a string (SGLang's type) of the integer the caller increments per sync.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mrl.rollout.engine.checksum import tensor_checksum
from mrl.rollout.weight_sync.buckets import iter_buckets
from mrl.rollout.weight_sync.http import EngineCallError, EngineHttp
from mrl.rollout.weight_sync.transports import (
    DiskTransport,
    DistributedTransport,
    TensorTransport,
)

TRANSPORTS = ("distributed", "tensor", "disk")


class WeightVerifyError(RuntimeError):
    """An engine holds different values than the actor sent for a named tensor."""


@dataclass
class WeightSyncReport:
    weight_version: str
    transport: str
    timing_s: float
    bytes: int          # payload this rank sent (0 on non-source ranks)
    num_tensors: int
    num_buckets: int
    verified: bool

    def metrics(self) -> dict[str, float]:
        return {
            "timing_s/weight_sync": self.timing_s,
            "weight_sync/bytes": float(self.bytes),
            "weight_sync/num_tensors": float(self.num_tensors),
            "weight_sync/num_buckets": float(self.num_buckets),
        }


def _default_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class WeightSyncer:
    """Sender side of the weight sync on one trainer rank.

    engine_urls: every engine of the pool. engine_world_sizes: ranks per engine (its tp size).
    stage: this rank's pipeline stage. is_source / is_coordinator: see module docstring.
    drives_export: a non-source rank iterates ``named_tensors`` (and discards them) because the
    export's gathers are collectives its group shares with a source (the source's TP peers; with
    expert parallelism, every rank); False for the other DP replicas, which would only spend CPU.
    barrier: trainer-wide barrier (default: the default process group's). disk_dir: required
    for ``disk`` (a directory the engines can read); snapshot_dir: with another transport, also
    write each pushed version there (safetensors shards + version file) so that a restarted
    engine can be re-synced with ``disk_resync(snapshot_dir)``; costs one disk write per sync.
    cuda_ipc: ``tensor`` sends CUDA IPC handles (SGLang) or shared memory (the built-in engine, which
    refuses pickled tensors); None = IPC when CUDA is available.
    """

    def __init__(
        self,
        transport: str,
        engine_urls: Sequence[str],
        *,
        bucket_mb: float = 512,
        verify: bool = False,
        token: str | None = None,
        stage: int = 0,
        is_source: bool = True,
        is_coordinator: bool = True,
        drives_export: bool = True,
        barrier: Callable[[], None] | None = None,
        engine_world_sizes: Sequence[int] | None = None,
        master_address: str = "127.0.0.1",
        backend: str | None = None,
        disk_dir: str | None = None,
        snapshot_dir: str | None = None,
        timeout_s: float = 600.0,
        pause_mode: str = "retract",
        cuda_ipc: bool | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"rollout.weight_sync.transport must be one of {TRANSPORTS}, got {transport!r}")
        if not engine_urls:
            raise ValueError("WeightSyncer needs at least one engine url (rollout.num_engines >= 1)")
        if transport == "disk" and not disk_dir:
            raise ValueError("rollout.weight_sync.transport=disk needs a directory shared with the engines (disk_dir)")
        if pause_mode not in ("retract", "abort", "in_place"):
            raise ValueError(f"pause_mode must be retract, abort or in_place (SGLang's modes), got {pause_mode!r}")
        self.transport_name = transport
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.bucket_bytes = int(bucket_mb * 1024 * 1024)
        self.verify = verify
        self.stage = stage
        self.is_source = is_source
        self.is_coordinator = is_coordinator
        self.drives_export = drives_export
        self.barrier = barrier or _default_barrier
        ws = list(engine_world_sizes or [1] * len(engine_urls))
        if len(ws) != len(engine_urls):
            raise ValueError(f"engine_world_sizes has {len(ws)} entries for {len(engine_urls)} engines")
        self.http = EngineHttp(engine_urls, token=token, timeout_s=timeout_s)
        if transport == "distributed":
            self.transport: Any = DistributedTransport(self.http, stage, ws, master_address=master_address,
                                                       backend=backend, timeout_s=timeout_s)
        elif transport == "tensor":
            self.transport = TensorTransport(self.http, ws, use_cuda_ipc=cuda_ipc)
        else:
            self.transport = DiskTransport(self.http, disk_dir, stage)  # type: ignore[arg-type]
        # A copy of each pushed version on disk, for re-syncing a restarted engine (disk_resync);
        # the disk transport's own directory already is one.
        self.snapshot = DiskTransport(self.http, snapshot_dir, stage) if snapshot_dir and transport != "disk" else None
        self._initialized = False

    def init(self) -> None:
        """Collective with the engines for ``distributed`` (joins this stage's group): call once on
        every rank after the engines are healthy."""
        if self.is_source:
            self.transport.init()
        self._initialized = True

    def rejoin(self) -> None:
        """After an engine restarted: the ``distributed`` transport forms its group again (collective
        with the engines, call on every rank); the other transports reach a restarted engine as is."""
        if self.is_source and isinstance(self.transport, DistributedTransport):
            self.transport.rejoin()

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str, *,
             pause: bool = True) -> WeightSyncReport:
        """Push one full set of weights; see the module docstring for the protocol.

        ``pause=False``: the caller generates nothing now (a synchronous step, between its rollout and the
        next), so /pause_generation and /continue_generation are skipped — two round trips of the ~10 in
        a sync (docs/performance.md, 'No pause around a synchronous push'). The flush stays: it
        waits for anything still running (a request the client gave up on) to end before the load."""
        if not self._initialized:
            self.init()
        version = str(version)
        t0 = time.perf_counter()
        windowed = not isinstance(self.transport, DiskTransport)  # SGLang: disk loads need no window
        if self.is_coordinator:
            if pause:
                self.http.call_all("/pause_generation", {"mode": self.pause_mode})
            self._flush_when_idle()
            if isinstance(self.transport, DiskTransport):
                self.transport.clear()
            if self.snapshot is not None:
                self.snapshot.clear()
            if windowed:
                self.http.call_all("/begin_weight_update", {})
        self.barrier()
        sent: dict[str, str] = {}
        nbytes = ntensors = nbuckets = 0
        if self.is_source:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes):
                if self.verify:
                    sent.update((n, tensor_checksum(t)) for n, t in zip(bucket.names, bucket.tensors))
                self.transport.send(bucket, version)
                if self.snapshot is not None:
                    self.snapshot.send(bucket, version)
                nbytes += bucket.nbytes
                ntensors += len(bucket.names)
                nbuckets += 1
            self.transport.finish(version)
            if self.snapshot is not None:
                self.snapshot.finish(version)
        elif self.drives_export:
            for _ in named_tensors:  # TP gathers inside the export are collective: drive them
                pass
        self.barrier()
        if self.is_coordinator:
            if self.snapshot is not None:
                self.snapshot.mark_version(version)
            if windowed:
                self.http.call_all("/end_weight_update", {})
            else:
                self.transport.load_on_engines(version)
        self.barrier()  # every stage verifies only after the engines have finished loading
        error: Exception | None = None
        if self.verify and self.is_source:
            try:
                self._verify(sent, version)
            except Exception as e:  # noqa: BLE001 - raised after the last barrier, never deadlocks
                error = e
        self.barrier()
        if self.is_coordinator and error is None and pause:
            self.http.call_all("/continue_generation", {})
        if error is not None:
            raise error
        return WeightSyncReport(version, self.transport_name, time.perf_counter() - t0, nbytes, ntensors, nbuckets,
                                self.verify and self.is_source)

    def _flush_when_idle(self, poll_s: float = 0.05) -> None:
        """POST /flush_cache to every engine until each accepts: SGLang answers 400 while requests
        run (or wait, unless paused); after a retract/abort pause that ends within one step."""
        deadline = time.monotonic() + self.timeout_s
        pending = list(self.http.urls)
        while pending:
            still = []
            for url in pending:
                try:
                    self.http.call(url, "/flush_cache")
                except EngineCallError as e:
                    if e.status != 400 or time.monotonic() > deadline:
                        raise EngineCallError(f"{e} (engine still busy after {self.timeout_s:.0f} s of waiting to flush its "
                                              "cache before a weight sync)") from e
                    still.append(url)
            pending = still
            if pending:
                time.sleep(poll_s)

    def _verify(self, sent: dict[str, str], version: str) -> None:
        names = list(sent)
        for url in self.http.urls:
            body = self.http.call(url, "/weights_checksum", {"names": names})
            got = body.get("checksums", body)
            for n in names:
                if n not in got:
                    raise WeightVerifyError(f"engine {url} has no tensor {n!r} after weight sync {version}")
                if got[n] != sent[n]:
                    raise WeightVerifyError(
                        f"weight sync {version}: tensor {n!r} on engine {url} has checksum {got[n]} but the "
                        f"actor sent {sent[n]} (dtype/shape/mapping mismatch)"
                    )
            wv = body.get("weight_version")
            if wv is not None and str(wv) != version:
                raise WeightVerifyError(f"engine {url} reports weight_version {wv!r} after sync, expected {version!r}")

    def close(self) -> None:
        self.transport.close()
        self.http.close()


def disk_resync(directory: str, token: str | None = None, timeout_s: float = 600.0) -> Callable[[str], None]:
    """A pool ``resync(url)`` callback: load the last weights written to ``directory`` (disk
    transport, or a snapshot) into one restarted engine, under the version recorded there."""
    def resync(url: str) -> None:
        vfile = Path(directory) / "mrl_weight_version.txt"
        if not vfile.exists():
            raise FileNotFoundError(f"no weights to re-sync from: {vfile} missing (no disk sync happened yet)")
        http = EngineHttp([url], token=token, timeout_s=timeout_s)
        try:
            http.call(url.rstrip("/"), "/update_weights_from_disk",
                      {"model_path": str(directory), "weight_version": vfile.read_text().strip(), "flush_cache": True})
        finally:
            http.close()
    return resync
