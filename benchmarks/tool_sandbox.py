"""Per-call cost of the python tool's sandbox (docs/agent.md): the median wall time of N calls of a
trivial program in the sandbox (mrl/agent/builtin_tools.run_sandboxed, as the tool runs it) against
the same program as a plain ``python -I -c`` subprocess, interleaved so host load hits both alike.

    python benchmarks/tool_sandbox.py [--calls 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from mrl.agent.builtin_tools import run_sandboxed, sandbox_problem

PROGRAM = "print(1)"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    if (why := sandbox_problem()) is not None:
        print(f"no sandbox on this host: {why}")
        return 1
    boxed, plain = [], []
    for _ in range(args.calls):
        t = time.perf_counter()
        assert run_sandboxed(PROGRAM, 60.0, memory_mb=1024)[:2] == (0, "1\n")
        boxed.append(time.perf_counter() - t)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-c", PROGRAM], capture_output=True, check=True)
        plain.append(time.perf_counter() - t)
    mb, mp = statistics.median(boxed), statistics.median(plain)
    print(f"{args.calls} calls; host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, kernel {os.uname().release}")
    print(f"sandboxed python -I -c {PROGRAM!r}: median {mb * 1000:.0f} ms (min {min(boxed) * 1000:.0f}, max {max(boxed) * 1000:.0f})")
    print(f"plain     python -I -c {PROGRAM!r}: median {mp * 1000:.0f} ms (min {min(plain) * 1000:.0f}, max {max(plain) * 1000:.0f})")
    print(f"sandbox overhead per call: {(mb - mp) * 1000:.0f} ms (median difference)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
