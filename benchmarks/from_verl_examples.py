"""`mrl from-verl` over a verl checkout's launch scripts: how many translate, and how many of the YAMLs
`mrl plan` accepts as GPU runs (``cluster.device=cuda``), with the errors of the rest counted by key.

    .venv/bin/python benchmarks/from_verl_examples.py /path/to/verl [--dirs examples/grpo_trainer ...]

Reads the ``*.sh`` files of the given directories (default: examples/grpo_trainer, examples/ppo_trainer,
recipe/dapo); nothing of verl is imported. Prints one line per script and the totals.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

from mrl.config import ConfigError, load_config
from mrl.config.from_verl import translate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("verl", type=Path, help="a verl checkout")
    p.add_argument("--dirs", nargs="+", default=["examples/grpo_trainer", "examples/ppo_trainer", "recipe/dapo"])
    args = p.parse_args()
    scripts = sorted(f for d in args.dirs for f in (args.verl / d).glob("*.sh"))
    translated, planned, reasons = 0, 0, collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for f in scripts:
            try:
                t = translate([str(f)], read_file=lambda s: Path(s).read_text(errors="replace"))
            except ValueError as e:
                print(f"untranslated  {f.relative_to(args.verl)}: {e}")
                continue
            translated += 1
            out = Path(tmp) / "run.yaml"
            out.write_text(t.yaml())
            try:
                load_config(str(out), ["cluster.device=cuda"])
                planned += 1
                print(f"plan ok       {f.relative_to(args.verl)} ({len(t.unmapped)} keys not mapped)")
            except ConfigError as e:
                keys = sorted({m.group(1) for err in e.errors for m in [re.match(r"([\w.]+)", err)] if m})
                reasons.update(keys)
                print(f"plan refuses  {f.relative_to(args.verl)}: {'; '.join(keys)}")
    print(f"\n{len(scripts)} scripts, {translated} translated, {planned} accepted by mrl plan (cluster.device=cuda)")
    for key, n in reasons.most_common():
        print(f"  {n:3d} refused at {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
