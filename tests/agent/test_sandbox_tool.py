"""The python tool through the tool runner (issue 33): its time limit is the config's, a call's
whole tree ends with it whatever way it ends, nothing of it stays on disk, and a host that cannot
build the sandbox is refused by ``mrl plan`` rather than run unsandboxed."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from mrl.agent.builtin_tools import sandbox_problem
from mrl.agent.runner import ERROR, OK, TIMEOUT, ToolRunner
from mrl.agent.tools import load_tools
from tests.agent.test_sandbox import survivors

REPO = Path(__file__).resolve().parents[2]


def test_the_model_cannot_set_the_time_limit() -> None:
    params = load_tools(["python"])["python"].schema["function"]["parameters"]
    assert list(params["properties"]) == ["code"]


@pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox on this host: {sandbox_problem()}")
def test_every_way_a_call_ends_leaves_no_process_and_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the runner's worker directories go here
    token = f"tool-{uuid.uuid4().hex}"
    leave = (f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # {token}'], "
             "start_new_session=True)\n")
    calls = {"ok": leave + "open('mine', 'w').write('x'); print(open('mine').read())",
             "crash": leave + "import os; os.kill(os.getpid(), 9)",
             "timeout": leave + "while True: pass",
             "argument": None}
    runner = ToolRunner(workers=2, timeout_s=5.0, memory_mb=256)

    async def go():
        try:
            return await asyncio.gather(*(runner.call("python", {"code": c} if c else {"code": "1", "timeout_s": 999})
                                          for c in calls.values()))
        finally:
            await runner.aclose()
    ok, crash, timeout, argument = asyncio.run(go())
    assert (ok.status, ok.text) == (OK, "x\n"), ok
    assert crash.status == OK and "killed (SIGKILL)" in crash.text, crash
    # the tool stops its program 0.5 s before the runner's limit; on a loaded host the runner's may come first
    assert (timeout.status == OK and "ran longer than 4.5 s" in timeout.text) or timeout.status == TIMEOUT, timeout
    assert argument.status == ERROR and "timeout_s" in argument.text, argument
    assert survivors(token) == []
    assert os.listdir(tmp_path) == []


def test_plan_refuses_the_python_tool_where_no_sandbox_can_be_built() -> None:
    # a user namespace allowed no nested ones: unshare fails as on a host with user namespaces off
    probe = ("from mrl.agent.builtin_tools import sandbox_problem as p; from mrl.config.agent import AgentConfig; "
             "from mrl.config import validate; print(p()); errors = []; "
             "cfg = type('C', (), {'agent': AgentConfig(enable=True, tools=['python'])})(); "
             "validate._check_agent_sandbox(cfg, errors); print(errors)")
    script = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c \"{probe}\""
    r = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", script], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)
    if r.returncode and "unshare" in r.stderr and not r.stdout:
        pytest.skip(f"cannot make a user namespace here: {r.stderr.strip()}")
    why, errors = r.stdout.splitlines()
    assert "unshare" in why and "agent.tools" in errors and "remove python from agent.tools" in errors, r.stdout + r.stderr
