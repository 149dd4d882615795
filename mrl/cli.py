"""``mrl`` command line: ``plan``, ``train``, ``engine`` and ``from-verl``.

Exit codes: 0 ok, 2 config or data errors (each printed with the key or file:row and the fix; also a checkpoint to
resume that is not one, is corrupt or was trained from another model), 3 a valid config that
this build's driver cannot run yet or whose files are missing (printed with the keys), 1 a run that stopped on an error (one line naming it; ``mrl train --debug``
shows the traceback), 130 interrupted. Only ``mrl.config`` (pydantic + PyYAML) is imported before a config is
valid, so ``mrl plan`` answers in well under 3 s; heavy stacks load lazily in ``train``/``engine``.
"""
from __future__ import annotations

import argparse
import sys

EXIT_CONFIG = 2
EXIT_UNSUPPORTED = 3
EXIT_FAILED = 1  # a run that stopped on an error after it started (the message names it; --debug: traceback)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrl", description="Megatron-Core RL trainer for LLMs (GRPO/PPO family).")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("plan", "validate CONFIG and print the resolved config and derived plan"),
                        ("train", "validate CONFIG, print the plan and start training")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("config", help="YAML run config, e.g. mrl_configs/quickstart.yaml")
        s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6 rollout.n=8")
        if name == "train":
            s.add_argument("--dry-run", action="store_true", help="stop after validation and the plan")
            s.add_argument("--debug", action="store_true", help="show the Python traceback of an error (hidden otherwise)")
    sub.add_parser("engine", help="run a rollout engine server (arguments go to mrl.rollout.engine.server)", add_help=False)
    sub.add_parser("from-verl", help="translate a verl launch script or its overrides into an mrl YAML", add_help=False)
    return p


def _from_verl(argv: list[str]) -> int:
    """``mrl from-verl <script.sh | key=value ...> [-o out.yaml]``: the YAML on stdout (or in -o's file), every
    verl key it could not carry over on stderr with the reason."""
    from pathlib import Path

    from mrl.config.from_verl import translate

    p = argparse.ArgumentParser(prog="mrl from-verl", description="Translate a verl launch command (a .sh script or "
                                "its Hydra overrides) into an mrl YAML; keys without an mrl equivalent are named.")
    p.add_argument("source", nargs="+", help="run_xxx.sh, or overrides such as actor_rollout_ref.actor.optim.lr=1e-6")
    p.add_argument("-o", "--output", help="write the YAML here instead of stdout")
    # verl's own words (`python3 -m verl.trainer.main_ppo`) may come along: only -o/-h are options here
    output, src, rest = None, [], list(argv)
    while rest:
        a = rest.pop(0)
        if a in ("-o", "--output") and rest:
            output = rest.pop(0)
        elif a in ("-h", "--help") or a in ("-o", "--output"):
            p.print_help()
            return 0 if a in ("-h", "--help") else EXIT_CONFIG
        else:
            src.append(a)
    if not src:
        p.print_usage(sys.stderr)
        return EXIT_CONFIG
    if len(src) == 1 and src[0].endswith(".sh") and not Path(src[0]).is_file():
        print(f"mrl from-verl: script {src[0]!r} does not exist; fix: the path of a verl launch script", file=sys.stderr)
        return EXIT_CONFIG
    try:
        t = translate(src, read_file=lambda f: Path(f).read_text(errors="replace"))
    except ValueError as e:
        print(f"mrl from-verl: {e}; fix: pass a verl launch script or its key=value overrides", file=sys.stderr)
        return EXIT_CONFIG
    if not t.config:
        print("mrl from-verl: no verl key could be carried over; fix: pass verl's key=value overrides", file=sys.stderr)
        return EXIT_CONFIG
    text = t.yaml()
    if output:
        try:
            Path(output).write_text(text)
        except OSError as e:  # a directory, a missing directory, a read-only place
            print(f"mrl from-verl: cannot write -o {output!r} ({e.strerror or e}); fix: -o a file path in an existing, "
                  "writable directory", file=sys.stderr)
            return EXIT_CONFIG
        print(f"mrl from-verl: wrote {output}; check it with `mrl plan {output}`", file=sys.stderr)
    else:
        print(text, end="")
    for key, value, why in t.unmapped:
        print(f"not mapped: {key}={value}: {why}", file=sys.stderr)
    return 0


def _load(config: str, overrides: list[str], *, require_data: bool):
    """(cfg, text) or print the errors and return None. ``require_data``: a missing prompt file is an
    error (``mrl train``), not a plan note."""
    from mrl.config import ConfigError, load_config
    from mrl.config.data_files import check_data_files
    from mrl.config.plan_report import plan_text

    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"mrl: {e}", file=sys.stderr)
        print("fix the keys above (see docs/config.md); nothing was started.", file=sys.stderr)
        return None
    data = check_data_files(cfg, require_present=require_data)
    if data.errors:
        print(f"mrl: {len(data.errors)} data error(s):", file=sys.stderr)
        print("\n".join(f"  - {e}" for e in data.errors), file=sys.stderr)
        print("fix the files or keys above; nothing was started.", file=sys.stderr)
        return None
    text = plan_text(cfg)
    return cfg, text + ("\n" + data.summary(cfg) if data.rows else "")


def _console_logging() -> None:
    """mrl's INFO messages (progress, fallbacks in use, where the curves went) on stderr; MRL_LOG_LEVEL=DEBUG
    adds verl's full metric line per step (also in <run dir>/metrics.log)."""
    import logging
    import os

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[mrl] %(message)s"))
    root = logging.getLogger("mrl")
    root.addHandler(handler)
    root.setLevel(os.environ.get("MRL_LOG_LEVEL", "INFO").upper())


def main(argv: list[str] | None = None) -> int:
    """Console-script entry (``mrl=mrl.cli:main``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "engine":
        # Lazy: the engine server brings torch/transformers (and SGLang when chosen).
        from mrl.rollout.engine.server import cli_main

        return int(cli_main(argv[1:]) or 0)
    if argv and argv[0] == "from-verl":
        return _from_verl(argv[1:])
    dry_run = bool(argv) and argv[0] == "train" and "--dry-run" in argv
    debug = bool(argv) and argv[0] == "train" and "--debug" in argv
    if dry_run or debug:
        # argparse cannot take an option between two runs of positionals (`CONFIG --dry-run k=v`).
        argv = [a for a in argv if a not in ("--dry-run", "--debug")]
    args = _parser().parse_args(argv)
    loaded = _load(args.config, args.overrides, require_data=args.cmd == "train" and not dry_run)
    if loaded is None:
        return EXIT_CONFIG
    cfg, text = loaded
    print(text, flush=True)
    from mrl.config.checkpoint_files import vision_language_refusal

    refusal = vision_language_refusal("model.path", cfg.model.path)
    if refusal:  # after the plan and the prompt files' pictures, which are checked in full (docs/vision.md)
        print(f"mrl {args.cmd}: {refusal}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    if args.cmd == "plan" or dry_run:
        return 0
    try:
        return _train(cfg)
    except KeyboardInterrupt:
        print("\nmrl train: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        stopped = _stopped_message(e, cfg.trainer.checkpoint_dir or "outputs")
        if stopped:
            print(f"\nmrl train: {stopped}", file=sys.stderr)
            return EXIT_FAILED
        print(f"\nmrl train: stopped by {_where(e)}\n(run `mrl train --debug ...` for the Python traceback; the run's "
              "log directory has the workers' logs)", file=sys.stderr)
        return EXIT_FAILED


def _stopped_message(e: BaseException, run_dir: str) -> str | None:
    """The whole report of a fault the run stopped on (RunStoppedError), or of a full disk met by the
    driver's own writers (checkpoint state, metrics log, MLflow's store): one line naming the file (else
    ``run_dir``, where the driver writes) and the free space, not an OSError traceback. None: report ``e``
    as an error with its location."""
    import errno

    from mrl.errors import RunStoppedError

    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, RunStoppedError):
            return str(x)
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            from mrl.driver.disk_full import disk_full_message

            return disk_full_message(x.filename, x.strerror or str(x), run_dir)
        x = x.__cause__ or x.__context__
    return None


def _where(e: BaseException) -> str:
    """``Type: message (file:line in fn)`` of the innermost frame: enough to report, no traceback."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    msg = str(e).strip()
    if "Traceback (most recent call last)" in msg:  # a Ray actor's error carries the remote traceback as text
        lines = [ln for ln in msg.splitlines() if ln.strip()]
        msg = f"{lines[0]} ... {lines[-1].strip()}"
    return f"{type(e).__name__}: {msg[:2000]}{at}" if msg else f"{type(e).__name__}{at}"


def _train(cfg) -> int:
    """Preflight (every checkpoint and tokenizer, before Ray), then the run; user errors -> exit 2/3."""
    from mrl.config.preflight import train_preflight
    from mrl.config.validate import missing_inputs

    missing = missing_inputs(cfg)
    if missing:  # exit 3 as before: the plan may be made before the download
        print("\nmrl train: " + "\n  ".join(missing), file=sys.stderr)
        return EXIT_UNSUPPORTED
    errors = train_preflight(cfg)
    if errors:
        print("\nmrl train: " + "\n  - ".join(["checkpoint error(s):", *errors]) + "\nnothing was started.",
              file=sys.stderr)
        return EXIT_CONFIG
    from mrl.data.dataset import DataError
    from mrl.errors import InputRefusedError, UnsupportedConfigError
    from mrl.train import run

    _console_logging()
    try:
        run(cfg)
    except InputRefusedError as e:  # a user mistake found before Ray (another model's checkpoint): as a config error
        print(f"\nmrl train: {e}\nnothing was started.", file=sys.stderr)
        return EXIT_CONFIG
    except UnsupportedConfigError as e:
        print(f"\nmrl train: {e}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    except DataError as e:  # a prompt file's row: found while the data loads, before Ray starts
        print(f"\nmrl train: {e}\nfix the data above; nothing was started.", file=sys.stderr)
        return EXIT_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
