"""``mrl-ckpt``: convert between Hugging Face and Megatron dist checkpoints, reshard, inspect.

    mrl-ckpt hf-to-mcore --hf DIR --out DIR --tp N --pp M [--vpp K] [--ep E [--etp T]] [--dtype bf16]
    mrl-ckpt mcore-to-hf --mcore DIR --out DIR [--hf-template DIR] [--tp N --pp M --ep E] [--dtype bf16]
    mrl-ckpt mcore-to-peft --mcore DIR --out DIR [--tp N --pp M]   (LoRA checkpoints: the adapter alone)
    mrl-ckpt reshard --in DIR --out DIR --tp N --pp M [--vpp K] [--ep E [--etp T]]
    mrl-ckpt inspect DIR [--no-checksums]

``--ep``/``--etp`` lay Mixture-of-Experts layers out over expert-parallel ranks (experts are stored
under global indices, so any EP loads any other). ``--ckpt`` is accepted for ``--mcore`` / ``--in``.
The command starts pp × lcm(tp, ep×etp) ranks itself (gloo on
CPU, NCCL when enough GPUs are visible; ``--device`` overrides), writes into a hidden temp
directory next to ``--out`` and renames it at the end, so a failed run leaves no half checkpoint.
A non-empty ``--out`` is refused unless ``--force``. Exit status: 0 ok, 1 conversion error,
2 usage or input error (a flag, a path, a layout the model cannot take, an input checkpoint whose
tensors are missing or do not fit its config.json): one sentence naming what to fix.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from checkpoints_tools.preflight import (
    CheckpointInputError,
    PreflightError,
    check_hf_weights,
    check_host,
    check_layout,
)
from mrl.config.parallel import UNEVEN_KEYS
from mrl.dtypes import DTYPES, SHORT_TO_NAME


class UsageError(Exception):
    """Bad command-line input (exit status 2)."""


def _exit_on_signal(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # unwinds through the finally blocks: ranks killed, temp directory removed


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: NCCL on GPUs when tp*pp are visible, else gloo on CPU")
    p.add_argument("--timeout", type=int, default=3600, help="seconds before all ranks are stopped")


def _expert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    p.add_argument("--etp", type=int, default=None, help="tensor-parallel size inside experts (default: --tp)")


def _stage_args(p: argparse.ArgumentParser) -> None:
    for k in UNEVEN_KEYS:
        p.add_argument("--" + k.replace("_", "-"), type=int, default=None, dest=k,
                       help=f"uneven pipeline stages: the {k.split('_')[4]} stage's layer count (Megatron's {k}; "
                            "the other stages split the rest evenly)")


def _uneven(args: argparse.Namespace) -> dict[str, int]:
    """The uneven-split flags that are set, as Megatron TransformerConfig kwargs."""
    return {k: getattr(args, k) for k in UNEVEN_KEYS if getattr(args, k, None) is not None}


def _experts(args: argparse.Namespace) -> tuple[int, int | None]:
    """(ep, etp) of an MoE command (1, None when the sub-command has no expert flags)."""
    return getattr(args, "ep", 1), getattr(args, "etp", None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mrl-ckpt", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="print full rank tracebacks on error")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron dist checkpoint")
    p.add_argument("--hf", required=True, type=Path, help="HF checkpoint dir (config.json + *.safetensors)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank")
    _stage_args(p)
    _expert_args(p)
    p.add_argument("--dtype", choices=sorted(SHORT_TO_NAME), default=None,
                   help="parameter dtype (default: config.json torch_dtype, else fp32)")
    _common(p)

    p = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors")
    p.add_argument("--mcore", "--ckpt", dest="ckpt", required=True, type=Path)
    p.add_argument("--hf-template", type=Path, default=None,
                   help="take config.json/tokenizer files from here instead of the checkpoint")
    p.add_argument("--tp", type=int, default=1, help="ranks used for loading (any layout works)")
    p.add_argument("--pp", type=int, default=1)
    _stage_args(p)
    _expert_args(p)
    p.add_argument("--dtype", choices=sorted(SHORT_TO_NAME), default=None, help="output dtype (default: as saved)")
    _common(p)

    p = sub.add_parser("mcore-to-peft", help="LoRA dist checkpoint -> peft adapter (adapter_config.json + "
                       "adapter_model.safetensors); mcore-to-hf gives the merged model")
    p.add_argument("--mcore", "--ckpt", dest="ckpt", required=True, type=Path)
    p.add_argument("--base-model", default=None, help="base_model_name_or_path to record (default: the training model.path)")
    p.add_argument("--tp", type=int, default=1, help="ranks used for loading (any layout works)")
    p.add_argument("--pp", type=int, default=1)
    _common(p)

    p = sub.add_parser("reshard", help="Megatron dist checkpoint -> same at another TP/PP/VPP")
    p.add_argument("--in", "--ckpt", dest="ckpt", required=True, type=Path)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--vpp", type=int, default=None)
    _stage_args(p)
    _expert_args(p)
    _common(p)

    p = sub.add_parser("inspect", help="layout, dtype, parameter count, per-tensor checksums")
    p.add_argument("ckpt", type=Path)
    p.add_argument("--no-checksums", action="store_true", help="skip reading tensor data")
    return parser


_MCORE_FILES = ("metadata.json", "common.pt", ".metadata")


def _input_dir(flag: str, path: Path, kind: str) -> None:
    """``path`` given for ``flag`` is a file: say so and what to pass (``kind``: "mcore" or "hf")."""
    if not path.is_file():
        return
    parent = path.resolve().parent
    if kind == "mcore" and all((parent / f).exists() for f in _MCORE_FILES):
        hint = f"pass the checkpoint directory that holds it: {parent}"
    elif kind == "mcore" and (path.suffix == ".safetensors" or path.name.endswith(".json")):
        hint = ("that is a Hugging Face file; pass a Megatron checkpoint directory (metadata.json, common.pt, "
                "*.distcp: what `mrl-ckpt hf-to-mcore --out` or a training run's checkpoints/global_step_N/actor holds)")
    elif kind == "hf" and (parent / "config.json").is_file():
        hint = f"pass the Hugging Face checkpoint directory that holds it: {parent}"
    else:
        hint = ("pass a Megatron checkpoint directory (metadata.json, common.pt, *.distcp)" if kind == "mcore"
                else "pass a Hugging Face checkpoint directory (config.json + *.safetensors)")
    where = flag if flag.startswith("--") else f"{flag} was given"
    raise UsageError(f"{where} {path}: that is a file, not a checkpoint directory; fix: {hint}")


def _prepare_out(out: Path, force: bool, inputs: list[Path]) -> Path:
    """Check ``out`` and return a fresh temp dir beside it (renamed onto ``out`` at the end)."""
    given, out = out, out.resolve()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    for inp in inputs:
        inp = inp.resolve()
        if out == inp or inp in out.parents or out in inp.parents:
            raise UsageError(f"--out {out} overlaps the input {inp}; choose a separate directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise UsageError(f"--out {out} is not empty; choose an empty directory or pass --force to replace it")
    from checkpoints_tools.preflight import sweep_stale_tmp

    sweep_stale_tmp(out)  # left by a conversion that was killed (SIGKILL runs no clean-up)
    tmp = out.parent / f".{out.name}.mrl-ckpt-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UsageError(f"--out {given} cannot be written: {_unwritable(out.parent, e)}; fix: an --out under a "
                         "directory you can write to (it is created with its missing parents)") from None
    return tmp


def _unwritable(parent: Path, e: OSError) -> str:
    """Why a directory cannot be created under ``parent`` (its nearest existing ancestor, and the OS's reason)."""
    anc = parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        return f"{anc} is a file, not a directory"
    if anc == parent:
        return f"a directory cannot be created in {parent} ({e.strerror})"
    return f"{parent} does not exist and cannot be created in {anc} ({e.strerror})"


def _finish(tmp: Path, out: Path) -> None:
    out = out.resolve()
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _check_sizes(args: argparse.Namespace) -> int:
    """Ranks to start: pp × lcm(tp, ep × etp) (Megatron's dense and expert grids over the same ranks)."""
    import math

    for name in ("tp", "pp", "ep", "etp"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "vpp", None) is not None and (args.vpp < 1 or (args.pp == 1 and args.vpp > 1)):
        raise UsageError(f"--vpp {args.vpp} needs --pp > 1; leave --vpp out for no interleaving")
    ep, etp = _experts(args)
    return args.pp * math.lcm(args.tp, ep * (etp or args.tp))


def _config_dtype(hf_dir: Path) -> str:
    cfg = json.loads((hf_dir / "config.json").read_text())
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return DTYPES.get(name, DTYPES["float32"])[0]  # the short name; an unknown dtype converts in fp32


def _hf_to_mcore(args: argparse.Namespace) -> None:
    from checkpoints_tools.convert import hf_param_count, hf_to_mcore_rank
    from checkpoints_tools.launch import pick_device, run_local_ranks
    from mrl.megatron.checkpoint import verify_checkpoint
    from mrl.megatron.hf_io import CARRIED_NAME, copy_hf_side_files
    from mrl.megatron.provider import load_hf_config, model_family

    world = _check_sizes(args)
    _input_dir("--hf", args.hf, "hf")
    if not (args.hf / "config.json").is_file():
        raise UsageError(f"--hf {args.hf} has no config.json; point it at a Hugging Face checkpoint directory")
    try:
        model_family(load_hf_config(args.hf))  # unsupported architectures fail before any rank starts
    except ValueError as e:
        raise UsageError(f"--hf {args.hf}: {e}") from e
    check_hf_weights(args.hf)
    check_layout(args, args.hf)
    n_in = hf_param_count(args.hf)
    dtype = args.dtype or _config_dtype(args.hf)
    device = pick_device(args.device, world)
    check_host(world, device)
    tmp = _prepare_out(args.out, args.force, [args.hf])
    try:
        print(f"hf-to-mcore: {args.hf} -> {args.out} (tp={args.tp} pp={args.pp} vpp={args.vpp}, "
              f"{dtype}, {world} {device} ranks)", flush=True)
        run_local_ranks(hf_to_mcore_rank, world, (str(args.hf), str(tmp), args.tp, args.pp, args.vpp,
                        dtype, device, args.timeout, *_experts(args), _uneven(args)), device=device,
                        timeout_s=args.timeout)
        copy_hf_side_files(args.hf, tmp)
        carried = _write_carried(args.hf, tmp)
        n_out = _mcore_param_count(verify_checkpoint(tmp))
        _finish(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"parameters in (HF): {n_in:,}; out (Megatron, vocab padded for tp={args.tp}): {n_out:,}"
          + (f"; {carried:,} carried untouched ({CARRIED_NAME}: the vision tower / MTP layers)" if carried else ""))


def _write_carried(hf_dir: Path, dest: Path) -> int:
    """The HF tensors mrl does not train (``Family.wrapped``) into ``dest/carried.safetensors``; their parameters."""
    from mrl.megatron.hf_io import CARRIED_NAME, carried_tensors
    from mrl.megatron.provider import load_hf_config

    tensors = carried_tensors(hf_dir, load_hf_config(hf_dir))
    if not tensors:
        return 0
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors}, str(dest / CARRIED_NAME), metadata={"format": "pt"})
    return sum(t.numel() for _, t in tensors)


def _mcore_param_count(info: dict) -> int:
    from checkpoints_tools.inspect_ckpt import _numel

    return sum(_numel(s) for k, s in info["tensors"].items() if not k.startswith("optimizer"))


def _stage_side_files(ckpt: Path, template: Path | None, meta: dict, dest: Path) -> None:
    """config.json + tokenizer into ``dest``: from the template, the checkpoint, or its metadata."""
    from mrl.megatron.hf_io import copy_hf_side_files

    src = template or ckpt
    if template is not None and not (template / "config.json").is_file():
        raise UsageError(f"--hf-template {template} has no config.json")
    copy_hf_side_files(src, dest)
    if not (dest / "config.json").is_file():
        if not meta.get("hf_config"):
            raise UsageError(f"{ckpt} records no HF config; pass --hf-template DIR holding config.json")
        (dest / "config.json").write_text(json.dumps(meta["hf_config"], indent=2))


def _carried_stage(ckpt: Path, template: Path | None, tmp: Path) -> dict:
    """The carried tensors (the Megatron checkpoint's carried.safetensors, else the --hf-template checkpoint's
    vision tower / MTP tensors) as one more "stage" for merge_stage_dirs; {} when there are none."""
    from mrl.megatron.hf_io import carried_tensors, write_hf_checkpoint
    from mrl.megatron.provider import load_hf_config

    cfg = load_hf_config(tmp)  # the staged config.json
    tensors = carried_tensors(ckpt, cfg) or (carried_tensors(template, cfg) if template else [])
    if not tensors:
        return {}
    stage_dir = tmp / "stage-carried"
    return {"stage": 1 << 30, "dir": str(stage_dir), "files": write_hf_checkpoint(stage_dir, tensors)}


def _mcore_to_hf(args: argparse.Namespace) -> None:
    from checkpoints_tools.convert import (
        hf_param_count,
        mcore_to_hf_rank,
        merge_stage_dirs,
    )
    from checkpoints_tools.launch import pick_device, run_local_ranks
    from mrl.megatron.checkpoint import verify_checkpoint

    world = _check_sizes(args)
    _input_dir("--mcore", args.ckpt, "mcore")
    info = verify_checkpoint(args.ckpt)  # missing/truncated shard files fail here, by name
    meta = info["metadata"]
    model_dtype = str(meta.get("params_dtype", "float32"))
    out_dtype = args.dtype or model_dtype
    check_layout(args, args.ckpt)
    device = pick_device(args.device, world)
    check_host(world, device)
    tmp = _prepare_out(args.out, args.force, [args.ckpt])
    try:
        _stage_side_files(args.ckpt, args.hf_template, meta, tmp)
        print(f"mcore-to-hf: {args.ckpt} -> {args.out} (load at tp={args.tp} pp={args.pp}, "
              f"{world} {device} ranks)", flush=True)
        results = run_local_ranks(mcore_to_hf_rank, world, (str(args.ckpt), str(tmp), str(tmp), args.tp,
                                  args.pp, model_dtype, out_dtype, device, args.timeout, *_experts(args),
                                  _uneven(args)),
                                  device=device, timeout_s=args.timeout)
        results.append(_carried_stage(args.ckpt, args.hf_template, tmp))
        merge_stage_dirs(tmp, results)
        n_out = hf_param_count(tmp)
        _finish(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"parameters in (Megatron, vocab padded): {_mcore_param_count(info):,}; out (HF): {n_out:,}")


def _mcore_to_peft(args: argparse.Namespace) -> None:
    import torch

    from checkpoints_tools.convert import mcore_to_peft_rank
    from checkpoints_tools.launch import pick_device, run_local_ranks
    from mrl.megatron.checkpoint import verify_checkpoint
    from mrl.megatron.lora_io import read_lora_meta, write_peft

    world = _check_sizes(args)
    _input_dir("--mcore", args.ckpt, "mcore")
    lora = read_lora_meta(args.ckpt)
    if lora is None:
        raise UsageError(f"{args.ckpt} has no lora_config.json: not a LoRA checkpoint (actor.lora.rank was 0); "
                         "use mrl-ckpt mcore-to-hf for the full model")
    meta = verify_checkpoint(args.ckpt)["metadata"]
    check_layout(args, args.ckpt)
    device = pick_device(args.device, world)
    check_host(world, device)
    tmp = _prepare_out(args.out, args.force, [args.ckpt])
    try:
        _stage_side_files(args.ckpt, None, meta, tmp)
        results = run_local_ranks(mcore_to_peft_rank, world, (str(args.ckpt), str(tmp), args.tp, args.pp,
                                  str(meta.get("params_dtype", "float32")), device, args.timeout),
                                  device=device, timeout_s=args.timeout)
        tensors = {k: torch.from_numpy(v) for r in results for k, v in r.items()}
        for f in list(tmp.iterdir()):  # the config was for loading; a peft directory holds only its two files
            f.unlink()
        write_peft(tmp, tensors, lora, base_model=args.base_model)
        _finish(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"mcore-to-peft: {len(tensors)} adapter tensors (rank {lora['rank']}, alpha {lora['alpha']}, "
          f"{', '.join(lora['targets'])}) -> {args.out}")


def _reshard(args: argparse.Namespace) -> None:
    from checkpoints_tools.convert import reshard_rank
    from checkpoints_tools.launch import pick_device, run_local_ranks
    from mrl.megatron.checkpoint import verify_checkpoint

    world = _check_sizes(args)
    _input_dir("--in", args.ckpt, "mcore")
    info = verify_checkpoint(args.ckpt)
    meta = info["metadata"]
    if meta.get("has_optimizer"):
        print("note: reshard carries the weights only; the optimizer state is not copied", file=sys.stderr)
    check_layout(args, args.ckpt)
    device = pick_device(args.device, world)
    check_host(world, device)
    tmp = _prepare_out(args.out, args.force, [args.ckpt])
    try:
        _stage_side_files(args.ckpt, None, meta, tmp)
        lay = meta.get("layout", {})
        print(f"reshard: {args.ckpt} (tp={lay.get('tp')} pp={lay.get('pp')}) -> {args.out} "
              f"(tp={args.tp} pp={args.pp} vpp={args.vpp}, {world} {device} ranks)", flush=True)
        run_local_ranks(reshard_rank, world, (str(args.ckpt), str(tmp), str(tmp), args.tp, args.pp,
                        args.vpp, str(meta.get("params_dtype", "float32")), device, args.timeout, *_experts(args),
                        _uneven(args)),
                        device=device, timeout_s=args.timeout)
        from mrl.megatron.lora_io import LORA_META

        if (args.ckpt / LORA_META).is_file():  # the adapters were resharded too: keep them loadable
            shutil.copy2(args.ckpt / LORA_META, tmp / LORA_META)
        from mrl.megatron.hf_io import CARRIED_NAME

        if (args.ckpt / CARRIED_NAME).is_file():  # the vision tower / MTP tensors travel with the checkpoint
            shutil.copy2(args.ckpt / CARRIED_NAME, tmp / CARRIED_NAME)
        n_out = _mcore_param_count(verify_checkpoint(tmp))
        _finish(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"parameters in: {_mcore_param_count(info):,}; out: {n_out:,} (vocab padding follows tp)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import signal
    import threading

    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, _exit_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def _run(args: argparse.Namespace) -> int:
    from checkpoints_tools.launch import RankError

    try:
        if args.command == "hf-to-mcore":
            _hf_to_mcore(args)
        elif args.command == "mcore-to-hf":
            _mcore_to_hf(args)
        elif args.command == "mcore-to-peft":
            _mcore_to_peft(args)
        elif args.command == "reshard":
            _reshard(args)
        else:
            from checkpoints_tools.inspect_ckpt import inspect_checkpoint

            _input_dir("inspect", args.ckpt, "mcore")
            print(inspect_checkpoint(args.ckpt, checksums=not args.no_checksums))
    except (UsageError, PreflightError) as e:
        print(f"mrl-ckpt: error: {e}", file=sys.stderr)
        return 2
    except RankError as e:
        if args.debug:
            print(e.details, file=sys.stderr)
        prefix = f"{CheckpointInputError.__name__}: "
        if e.message.startswith(prefix):  # the input's problem, found by a rank: a sentence, as a usage error
            print(f"mrl-ckpt: error: {e.message.removeprefix(prefix)}", file=sys.stderr)
            return 2
        print(f"mrl-ckpt {args.command}: error: {e.message}  [rank {e.rank}; --debug for the traceback]",
              file=sys.stderr)
        return 1
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # CheckpointError, TimeoutError, ...
        if args.debug:
            raise
        print(f"mrl-ckpt {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # import-safe: spawned ranks and checkpoint writers re-import modules
    sys.exit(main())
