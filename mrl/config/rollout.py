"""Rollout section: the generation engine pool and the actor -> engine weight sync.

Each step generates ``data.train_batch_size * n`` samples (``n`` responses per prompt, GRPO
groups). Engines: ``num_engines`` servers, each over ``engine_tp_size`` devices; colocated engines share
the actor's devices (verl hybrid engine), separate ones get ``num_engines * engine_tp_size`` of their own (an SGLang
engine wider than a node spans whole nodes: config/validate_engines.py).
"""
from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import Field, field_validator

from mrl.config.base import Section

_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


class WeightSyncConfig(Section):
    """How updated actor weights reach the engines after each step."""

    transport: Literal["auto", "distributed", "tensor", "disk", "inprocess"] = Field(
        "auto", description="auto: the fastest valid one for the device and placement (inprocess on CPU where it fits, "
        "else tensor when colocated, distributed for separate engines; mrl plan says which and why; mrl/config/auto.py); "
        "distributed: NCCL/gloo broadcast (on CUDA: separate engines only); tensor: shared "
        "memory / CUDA IPC (colocated; on CUDA one node); disk: "
        "safetensors files; inprocess: the built-in engine runs inside each trainer rank and the rank copies its weights "
        "into it (CPU, colocated, actor TP = PP = 1; docs/weight_sync.md)."
    )
    bucket_mb: int = Field(512, ge=1, description="MB of flattened parameters sent per bucket.")
    verify: bool = Field(False, description="After a sync, compare a checksum of engine weights with the actor's (slow; debugging).")
    disk_dir: str | None = Field(
        None, description="Directory the disk transport writes safetensors to; null = <checkpoint dir>/weight_sync."
    )
    snapshot_dir: str | None = Field(
        None, description="Also keep a safetensors snapshot here so a restarted engine can re-sync (distributed/tensor)."
    )


class ValKwargsConfig(Section):
    """Sampling of the validation answers (verl ``actor_rollout_ref.rollout.val_kwargs``, same defaults).

    ``do_sample=false`` (default) decodes one greedy answer per prompt, as verl's HF rollout does;
    temperature/top_p/top_k are then unused and must stay at their defaults (``check_config``
    refuses a set-but-ignored value). ``do_sample=true`` samples ``n`` answers per prompt with them.
    """

    top_k: int = Field(-1, ge=-1, description="Top-k of validation sampling (>= 1); -1 disables. Used only with do_sample=true.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass of validation sampling. Used only with do_sample=true.")
    temperature: float = Field(
        0.0, ge=0, description="Validation sampling temperature; > 0 with do_sample=true, 0 (greedy) otherwise."
    )
    n: int = Field(
        1, ge=1, description="Answers per validation prompt: mean@n/std@n, and best@k/worst@k (k = 2, 4, ..., n) when > 1 (needs do_sample=true)."
    )
    do_sample: bool = Field(False, description="false: one greedy answer per prompt; true: sample n with temperature/top_p/top_k.")


class RolloutConfig(Section):
    """Generation engines and sampling parameters (verl ``actor_rollout_ref.rollout``)."""

    engine: Literal["torch", "sglang"] = Field("torch", description="torch: built-in engine (CPU/GPU, small models); sglang: SGLang servers (CUDA).")
    placement: Literal["colocated", "separate"] = Field(
        "colocated", description="colocated: engines share the actor's devices (hybrid); separate: engines get their own devices."
    )
    n: int = Field(1, ge=1, description="Responses sampled per prompt (GRPO/RLOO group size; recipes set > 1).")
    temperature: float = Field(1.0, description="Sampling temperature (> 0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling (>= 1); -1 disables.")
    max_response_length: int = Field(512, ge=1, description="TOKENS generated per response at most.")
    num_engines: int | None = Field(
        None, ge=1, description="Engine servers in the pool; null = actor devices / engine_tp_size when colocated."
    )
    engine_tp_size: int = Field(1, ge=1, description="Devices (tensor-parallel ranks) per engine server (SGLang; the "
                                "built-in torch engine: 1); more than "
                                "cluster.n_gpus_per_node only for SGLang engines with placement=separate, a multiple of "
                                "it (the engine then spans that many whole nodes, docs/driver.md).")
    mem_fraction_static: float = Field(
        0.6, gt=0, lt=1, description="Fraction of device memory an engine takes for weights + KV cache (SGLang mem_fraction_static)."
    )
    host: str = Field("127.0.0.1", description="Address engine servers bind to (loopback by default).")
    port_base: int = Field(30000, ge=1024, le=65000, description="First engine port; engine i listens on port_base + i.")
    router: Literal["builtin", "sglang_router"] = Field(
        "builtin", description="Load balancer across engines: mrl's (builtin) or SGLang's sglang_router package "
                               "(cache-aware; launched on the driver's host, works with both engines).")
    router_port: int | None = Field(
        None, ge=1024, le=65535, description="Port of sglang_router on 127.0.0.1 (null: port_base - 1).")
    request_timeout_s: float = Field(600.0, gt=0, description="Seconds before a generate request is abandoned.")
    max_retries: int = Field(3, ge=0, description="Retries of a failed generate request on another engine.")
    health_interval_s: float = Field(10.0, gt=0, description="Seconds between /health_generate probes of each engine.")
    engine_startup_timeout_s: float = Field(
        600.0, gt=0, description="Seconds an engine server may take to answer /health after launch."
    )
    free_cache_engine: bool | None = Field(
        None, description="Release engine memory (KV cache + weights, /release_memory_occupation) after each generation "
        "and restore it around the weight sync (verl free_cache_engine); null = on for colocated engines on CUDA, off otherwise.",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="Sequences an engine decodes together at most (verl max_num_seqs; SGLang "
        "--max-running-requests, the embedded engine's --max-running); null = the engine's default (embedded: 256).")
    partial_rollout: bool = Field(
        False, description="With trainer.async_training.max_staleness > 0: a weight push interrupts the generations in "
        "flight (SGLang pause_generation abort), keeps their tokens with the version that made them and continues them "
        "with the new weights (docs/async.md); false: the push waits for the producer's batch to finish.")
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="Actor -> engine weight transfer.")
    val_kwargs: ValKwargsConfig = Field(
        default_factory=ValKwargsConfig, description="Sampling of validation answers (verl val_kwargs; greedy by default)."
    )

    @field_validator("host")
    @classmethod
    def _host_is_an_address(cls, v: str) -> str:
        # Caught here, not when every engine fails to bind minutes later.
        try:
            ipaddress.ip_address(v)
            return v
        except ValueError:
            pass
        if not _HOSTNAME.match(v):
            raise ValueError(f"{v!r} is neither an IP address nor a host name; fix: e.g. rollout.host=127.0.0.1 (loopback) "
                             "or rollout.host=0.0.0.0 (all interfaces)")
        return v
