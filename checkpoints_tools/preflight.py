"""What ``mrl-ckpt`` checks before it starts a rank: the layout against the model (heads and KV heads by
TP, layers by PP x VPP, experts by EP), the rank count against this host (cores, memory), the input
weights' files (a truncated safetensors named, not a ``SafetensorError`` traceback from every rank),
and temp directories of earlier killed runs (removed)."""
from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path

# A CPU rank holds torch, Megatron and gloo before any weight: ~0.5 GiB of RSS measured per rank.
RANK_BASE_MIB = 512
# Ranks per core beyond which a conversion only thrashes (each rank gets at least one thread).
RANKS_PER_CORE = 4


class PreflightError(ValueError):
    """A layout, host or input problem found before any rank starts (``mrl-ckpt`` exits 2)."""


class CheckpointInputError(ValueError):
    """An input checkpoint a rank found unusable (a tensor missing, a tensor whose shape does not fit config.json):
    a user's file to fix, not a conversion failure, so ``mrl-ckpt`` exits 2 with the message alone. Raised in a rank;
    the parent recognises it by the ``CheckpointInputError: `` prefix of the rank's error line."""


def check_layout(args: argparse.Namespace, model_dir: Path) -> None:
    """``--tp/--pp/--vpp`` (and ``--ep`` where the command has it) shard the model of ``model_dir/config.json``."""
    from mrl.config.hf import read_model_shape
    from mrl.config.parallel import UNEVEN_KEYS, ParallelConfig
    from mrl.config.validate_parallel import check_model_fits

    try:
        shape = read_model_shape(str(model_dir))
    except ValueError as e:
        raise PreflightError(str(e)) from None
    if shape is None:
        return  # no config.json to check against (mcore dirs written before side files were copied)
    par = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                         virtual_pipeline_model_parallel_size=getattr(args, "vpp", None),
                         expert_model_parallel_size=getattr(args, "ep", None) or 1,
                         **{k: getattr(args, k) for k in UNEVEN_KEYS if getattr(args, k, None) is not None})
    errors: list[str] = []
    check_model_fits("layout", par, shape, f"{model_dir}/config.json", errors)
    if errors:
        text = "; ".join(errors).replace("layout.tensor_model_parallel_size", "--tp").replace(
            "layout.expert_model_parallel_size", "--ep").replace("choose a TP", "choose a --tp").replace(
            "choose PP (x VPP)", "choose --pp (x --vpp)").replace("pipeline_model_parallel_size", "--pp")
        for k in UNEVEN_KEYS:
            text = text.replace(f"layout.{k}", "--" + k.replace("_", "-"))
        raise PreflightError(text)


def _mem_available_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_host(world: int, device: str) -> None:
    """Refuse a CPU rank count this host cannot hold (a far larger --tp exhausted its memory)."""
    if device != "cpu":
        return  # pick_device already checked the visible GPUs
    cores = os.cpu_count() or 1
    if world > RANKS_PER_CORE * cores:
        raise PreflightError(f"--tp x --pp = {world} CPU ranks on {cores} cores (at most {RANKS_PER_CORE * cores}: "
                             f"each rank is a process with its own torch); fix: a smaller layout (the output layout "
                             "can be reached later with `mrl-ckpt reshard` on a larger host)")
    avail = _mem_available_mib()
    if avail is not None and world * RANK_BASE_MIB > avail:
        raise PreflightError(f"--tp x --pp = {world} CPU ranks need about {world * RANK_BASE_MIB} MiB before any weight "
                             f"({RANK_BASE_MIB} MiB each) but {avail} MiB are available; fix: fewer ranks")


def check_hf_weights(hf_dir: Path) -> None:
    """Every safetensors file of ``hf_dir`` is whole (headers parse, tensors end inside the file) and its tensors'
    shapes fit config.json (:mod:`mrl.config.weights_fit`, the check ``mrl plan`` runs)."""
    import json

    from mrl.config.checkpoint_files import safetensors_header, weight_files
    from mrl.config.weights_fit import weights_fit_errors

    try:
        files = weight_files(hf_dir)
        if files is None:
            raise PreflightError(f"--hf {hf_dir} holds neither model.safetensors nor model.safetensors.index.json "
                                 "(.bin checkpoints are not read: re-save with safe_serialization=True)")
        headers = {f: safetensors_header(f) for f in files}
    except (OSError, ValueError) as e:
        if isinstance(e, PreflightError):
            raise
        raise PreflightError(f"--hf: {e}; fix: re-download or re-save the checkpoint") from None
    try:
        cfg = json.loads((hf_dir / "config.json").read_bytes())
    except (OSError, ValueError):
        return  # check_layout names an unreadable config.json
    if isinstance(cfg, dict):
        errors = weights_fit_errors(f"--hf {hf_dir}", str(hf_dir), cfg, headers)
        if errors:
            raise PreflightError(errors[0])


_TMP_RE = re.compile(r"^\.(?P<name>.+)\.mrl-ckpt-tmp-(?P<pid>\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_tmp(out: Path) -> list[Path]:
    """Remove ``.<out>.mrl-ckpt-tmp-<pid>`` directories left by runs that were killed (SIGKILL skips every
    clean-up); a directory whose pid still runs is another conversion's and is kept."""
    out = out.resolve()
    removed = []
    if not out.parent.is_dir():
        return removed
    for d in out.parent.iterdir():
        m = _TMP_RE.match(d.name)
        if m and m["name"] == out.name and d.is_dir() and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed
