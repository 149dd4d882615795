"""A tool call's whole process tree dies with it: the worker leads a session of its own and the runner
kills its group at the call's limit (issue 33: 200 forked sleepers and the tool's loop survived the call)."""
import asyncio
import os
from pathlib import Path

import psutil

from mrl.agent.runner import TIMEOUT, ToolRunner

TOOLS = str(Path(__file__).with_name("tree_tools.py"))


def test_children_of_a_timed_out_call_are_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    runner = ToolRunner(workers=1, timeout_s=120.0, memory_mb=512)

    async def go():
        try:
            return await runner.call(f"{TOOLS}:spawn_and_hang", {"n": 5, "pidfile": str(pidfile)}, timeout_s=3.0)
        finally:
            await runner.aclose()

    out = asyncio.run(go())
    assert out.status == TIMEOUT
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 5
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.pid for p in alive]
    assert os.path.exists(pidfile)
