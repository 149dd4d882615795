"""Run tool calls in a pool of worker subprocesses (``python -m mrl.agent.worker``), asyncio-native.

Each worker serves one call at a time over a JSON-lines pipe, with RLIMIT_AS = ``memory_mb`` and
its own temporary working directory. A call that does not answer within ``timeout_s`` has its
worker killed (and replaced by a fresh one at the next call); a worker that dies mid-call (the
memory limit, a segfault, ``os._exit``) is replaced the same way. Either way the call returns a
``ToolOutcome`` whose text is an error message for the model, never an exception for the run.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

#: ``ToolOutcome.status`` values (metrics: agent/tool_errors counts error + timeout, agent/tool_timeouts timeout)
OK, ERROR, TIMEOUT = "ok", "error", "timeout"
STARTUP_TIMEOUT_S = 120.0


@dataclass
class ToolOutcome:
    """What a call gave the model: ``text`` is the tool message (the result, or the error)."""

    status: str
    text: str

    @property
    def ok(self) -> bool:
        return self.status == OK


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process, cwd: str) -> None:
        self.proc, self.cwd = proc, cwd

    async def kill(self) -> None:
        # the worker leads a session of its own: what its tool started (a program, forked sleepers) dies too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        shutil.rmtree(self.cwd, ignore_errors=True)


class ToolRunner:
    """``await runner.call(spec, arguments)``: at most ``workers`` calls run at once, each within
    ``timeout_s`` seconds and ``memory_mb`` MiB of address space. Use on one event loop; ``close()`` ends it."""

    def __init__(self, *, workers: int = 4, timeout_s: float = 10.0, memory_mb: int = 1024,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        from mrl.agent.worker import memory_limit_problem

        if workers < 1 or timeout_s <= 0 or memory_mb < 64 or startup_timeout_s <= 0:
            raise ValueError(f"ToolRunner(workers={workers}, timeout_s={timeout_s}, memory_mb={memory_mb}, "
                             f"startup_timeout_s={startup_timeout_s}): need workers >= 1, timeout_s > 0, "
                             "memory_mb >= 64, startup_timeout_s > 0")
        if (why := memory_limit_problem(memory_mb)) is not None:  # every worker would die at its setrlimit
            raise ValueError(f"agent.tool_memory_mb={memory_mb} (ToolRunner memory_mb): a tool worker cannot set this "
                             f"memory limit (RLIMIT_AS): {why}; fix: a smaller agent.tool_memory_mb")
        self.workers, self.timeout_s, self.memory_mb = workers, timeout_s, memory_mb
        self.startup_timeout_s = startup_timeout_s
        self._idle: list[_Worker] = []
        self._sem: asyncio.Semaphore | None = None
        self._all: set[_Worker] = set()

    async def _spawn(self) -> _Worker:
        cwd = tempfile.mkdtemp(prefix="mrl-tool-")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # mrl itself, the driver's working directory (pkg.module:fn tools) and its PYTHONPATH
        path = os.pathsep.join(p for p in (root, os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "MRL_TOOL_TIMEOUT_S": str(self.timeout_s)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mrl.agent.worker", "--memory-mb", str(self.memory_mb), cwd=cwd, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            limit=1 << 24, start_new_session=True)
        w = _Worker(proc, cwd)
        self._all.add(w)
        assert proc.stdout is not None
        timed_out = False
        try:  # generous: a loaded host starts an interpreter slowly, and the call's timeout starts after
            ready = await asyncio.wait_for(proc.stdout.readline(), self.startup_timeout_s)
        except TimeoutError:
            ready, timed_out = b"", True
        if ready.startswith(b'{"ready"'):
            return w
        self._all.discard(w)
        if timed_out:
            await w.kill()
            raise RuntimeError(f"a tool worker did not start within {self.startup_timeout_s:g} s (a loaded host?)")
        # it ended (or said why it could not start) before it was ready: no waiting out the timeout
        try:
            code = await asyncio.wait_for(proc.wait(), 5.0)
        except TimeoutError:
            code = None
        await w.kill()
        why = ""
        with contextlib.suppress(ValueError, AttributeError):
            why = json.loads(ready).get("startup_error", "")
        if not why:
            why = f"its first line was {ready[:200]!r}" if ready else "it wrote nothing"
        raise RuntimeError(f"a tool worker exited at start with exit code {code}: {why}")

    async def call(self, spec: str, arguments: dict[str, Any], timeout_s: float | None = None) -> ToolOutcome:
        """Run tool ``spec`` with ``arguments`` (keywords); the outcome, never an exception."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.workers)
        limit = self.timeout_s if timeout_s is None else timeout_s
        async with self._sem:
            try:
                w = self._idle.pop() if self._idle else await self._spawn()
            except (OSError, RuntimeError) as e:
                return ToolOutcome(ERROR, f"error: could not start a tool process: {e}")
            keep = False
            try:
                assert w.proc.stdin is not None and w.proc.stdout is not None
                w.proc.stdin.write((json.dumps({"spec": spec, "arguments": arguments}) + "\n").encode())
                await w.proc.stdin.drain()
                line = await asyncio.wait_for(w.proc.stdout.readline(), limit)
                if not line:  # the worker died mid-call
                    code = await w.proc.wait()
                    why = " (killed by the memory limit?)" if code < 0 or code == 1 else ""
                    return ToolOutcome(ERROR, f"error: the tool process died with exit code {code}{why}")
                keep = True
                ans = json.loads(line)
                if "ok" in ans:
                    return ToolOutcome(OK, str(ans["ok"]))
                return ToolOutcome(ERROR, f"error: {ans.get('error', ans)}")
            except TimeoutError:
                return ToolOutcome(TIMEOUT, f"error: the tool call did not finish within {limit:g} s and was stopped")
            except (OSError, ValueError) as e:  # broken pipe, a line that is not JSON
                keep = False
                return ToolOutcome(ERROR, f"error: the tool process failed: {e}")
            finally:
                if keep:
                    self._idle.append(w)
                else:
                    self._all.discard(w)
                    await w.kill()

    async def aclose(self) -> None:
        for w in list(self._all):
            await w.kill()
        self._all.clear()
        self._idle.clear()
