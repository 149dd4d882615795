"""torch.distributed + Megatron ``parallel_state`` set-up for one rank (CPU/gloo or CUDA/NCCL).

Rank layout is Megatron's default order ``tp-cp-ep-dp-pp``: with world size W,
``dp = W / (tp * pp * cp)``. MoE layers use Megatron's second ("expert") grid over the same ranks,
``etp-ep-edp-pp``: expert-tensor-parallel ``etp`` (default: ``tp``) × expert-parallel ``ep`` ×
expert-data-parallel ``edp = W / (etp * ep * pp)``, so EP may fold over TP and DP ranks alike. The process group is read from the usual environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``), the same contract as
``torchrun`` and our Ray worker groups.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_DEVICES = ("cpu", "cuda")


def init_parallel(
    *,
    device: str,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    seed: int = 1234,
    timeout_s: int = 300,
) -> None:
    """Initialise torch.distributed (if needed), CPU support on CPU, Megatron groups and RNG.

    ``device="cpu"`` uses gloo and :func:`mrl.megatron.cpu_support.enable_cpu_support`;
    ``device="cuda"`` uses NCCL and binds this process to ``LOCAL_RANK``. The model-parallel RNG
    (``model_parallel_cuda_manual_seed``) gets ``seed``; ``torch.manual_seed(seed)`` is set too so
    that weight initialisation is identical on every rank of a data-parallel group.
    """
    if device not in _DEVICES:
        raise ValueError(f"cluster.device must be one of {_DEVICES}, got {device!r}")
    etp = tp if etp is None else etp
    for name, val in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp)):
        if val < 1:
            raise ValueError(f"parallel size {name}={val} must be >= 1")
    if vpp is not None and (vpp < 1 or pp == 1 and vpp > 1):
        raise ValueError(f"vpp={vpp} needs pp > 1 (got pp={pp}); leave vpp unset for no interleaving")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "cluster.device is 'cuda' but no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver, "
            "CPU-only torch?); set cluster.device: cpu to run on CPU with gloo"
        )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if device == "cpu":
        # The only place CPU support is switched on: never with device == "cuda".
        from mrl.megatron.cpu_support import enable_cpu_support

        enable_cpu_support()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))

    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"torch.distributed is not initialised and env vars {missing} are unset; launch "
                "with torchrun / the mrl worker group, or set them for a single process "
                "(RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500)"
            )
        dist.init_process_group(
            "gloo" if device == "cpu" else "nccl",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0 or world % (etp * ep * pp) != 0:
        raise ValueError(
            f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} and by the expert grid "
            f"etp*ep*pp = {etp}*{ep}*{pp}; change the parallel sizes or the number of ranks"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=max(1, timeout_s // 60),
        # gloo groups are what the CPU path communicates over; on CUDA they serve
        # the distributed optimizer's CPU-side checkpoint gathers.
        create_gloo_process_groups=True,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down Megatron groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
