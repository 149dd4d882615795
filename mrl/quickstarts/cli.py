"""``python -m mrl.quickstarts <demo> [--out DIR] [--seed N] [--force] [demo flags]``: the demos' one CLI.

A demo module exposes ``DEMO``: its name, default output directory and seed, its own flags, and a
``write(args)`` that writes what is missing (everything with ``--force``) and returns
``{asset path: "written ..." | "kept"}``. A bad flag value raises :class:`UsageError`, which becomes
argparse's usage error (exit 2, no traceback); an asset that cannot be written as promised raises
:class:`DemoFailed`, whose one-line message (what was reached, the fix) is printed with exit 1.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

# demo name -> module; imported only when chosen (each pulls in torch/transformers)
DEMOS = {"base": "mrl.quickstarts.base", "rm": "mrl.quickstarts.rm", "agent": "mrl.quickstarts.agent",
         "moe": "mrl.quickstarts.moe", "distill": "mrl.quickstarts.distill", "judge": "mrl.quickstarts.judge",
         "qwen3_5": "mrl.quickstarts.hybrid", "vlm": "mrl.quickstarts.vlm"}


class UsageError(ValueError):
    """A flag value the demo cannot use; the message names the flag."""


class DemoFailed(RuntimeError):
    """An asset that missed its target; the one-line message says what was reached and the fix."""


@dataclass(frozen=True)
class Demo:
    name: str
    summary: str
    default_out: str | None  # None (both): the demo picks them from its other flags (the MoE demo: per --family)
    default_seed: int | None
    add_arguments: Callable[[argparse.ArgumentParser], None]
    write: Callable[[argparse.Namespace], dict[str, str]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mrl.quickstarts",
                                description="Write a CPU demo's tiny model and data locally (no download).")
    sub = p.add_subparsers(dest="demo", required=True, metavar="DEMO", help="one of: " + ", ".join(DEMOS))
    demos, parsers = {}, {}
    for name, module in DEMOS.items():
        demo = demos[name] = importlib.import_module(module).DEMO  # stdlib-only at import: torch loads in write()
        sp = parsers[name] = sub.add_parser(name, help=demo.summary, description=demo.summary)
        sp.add_argument("--out", default=demo.default_out, help="output directory (default: " + (
            "per the demo's flags, see below)" if demo.default_out is None else f"{demo.default_out})"))
        sp.add_argument("--seed", type=int, default=demo.default_seed,
                        help="seed of the weights and data (default " + (
                            "per the demo's flags, see below)" if demo.default_seed is None else f"{demo.default_seed})"))
        sp.add_argument("--force", action="store_true", help="rewrite assets that are already present")
        demo.add_arguments(sp)
    args = p.parse_args(argv)
    try:
        status = demos[args.demo].write(args)
    except UsageError as e:
        parsers[args.demo].error(str(e))
    except DemoFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for asset, what in status.items():
        print(f"{what}: {asset}" + ("  (present; --force rewrites it)" if what == "kept" else ""))
    return 0
