"""The built-in tools: ``calculator`` (exact arithmetic on an expression) and ``python`` (run a
program in a sandbox of its own, mrl/agent/sandbox.py). Both run inside a tool worker subprocess
(mrl/agent/runner.py), under its memory limit and per-call timeout.
"""
from __future__ import annotations

import ast
import functools
import json
import operator
import os
import resource
import signal
import subprocess
import sys
import tempfile
import typing

from mrl.agent import sandbox
from mrl.agent.tools import register_tool

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_POW_EXPONENT = 1000  # 9**10**9 would run the worker into its timeout instead of answering


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POW_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_POW_EXPONENT}")
        return _BIN[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported syntax {ast.unparse(node)!r}: only numbers, + - * / // % ** and parentheses")


@register_tool("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay exact) and return the result.

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "4821 * 37"
    """
    value = _eval(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


SANDBOX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox.py")
DEFAULT_MEMORY_MB = 1024  # without a worker's limit (a direct call): agent.tool_memory_mb's default
SANDBOX_TMP_MB = 64  # the program's private /tmp (a tmpfs: memory, gone with the call)
PYTHON_OUTPUT_CHARS = 4000
TIMEOUT_ENV = "MRL_TOOL_TIMEOUT_S"  # set by mrl/agent/runner.py in every worker: the call's limit
_SIGNALS = {signal.SIGKILL: "killed (SIGKILL)", signal.SIGXCPU: "its CPU time limit was reached (SIGXCPU)",
            signal.SIGXFSZ: f"its file/output size limit ({sandbox.MAX_FILE_MB} MiB) was reached (SIGXFSZ)",
            signal.SIGSEGV: "it crashed (SIGSEGV)"}


class SandboxUnavailable(RuntimeError):
    """This host cannot build the python tool's sandbox (user namespaces disabled, no /proc...)."""


def _tail(f: typing.IO[bytes]) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - 4 * PYTHON_OUTPUT_CHARS))
    return f.read().decode("utf-8", errors="replace")


def _memory_mb() -> int:
    """The program's address-space limit: the worker's own (agent.tool_memory_mb, set by the worker)."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return DEFAULT_MEMORY_MB if soft == resource.RLIM_INFINITY else max(64, soft >> 20)


def run_sandboxed(code: str, timeout_s: float, memory_mb: int | None = None,
                  tmp_mb: int = SANDBOX_TMP_MB) -> tuple[int, str, str]:
    """(exit status, stdout tail, stderr tail) of ``python -I -c code`` in the sandbox
    (mrl/agent/sandbox.py); status 128+N for a signal N. Raises ``subprocess.TimeoutExpired`` past
    ``timeout_s`` (the launcher is killed, and with it the whole tree) and ``SandboxUnavailable``."""
    # unnamed files (O_TMPFILE): bounded by the program's RLIMIT_FSIZE, never left on disk; the
    # launcher's own errors go to a third one (a program cannot forge them)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as why:
        req = json.dumps({"code": code, "cpu_s": max(1, int(timeout_s) + 1), "tmp_mb": tmp_mb,
                          "memory_mb": memory_mb or _memory_mb(), "error_fd": why.fileno()}).encode()
        r = subprocess.run([sys.executable, "-I", "-S", SANDBOX], input=req, stdout=out, stderr=err, timeout=timeout_s,
                           check=False, pass_fds=(why.fileno(),))
        stdout, stderr, problem = _tail(out), _tail(err), _tail(why).strip()
    if problem:
        raise SandboxUnavailable(problem)
    return r.returncode, stdout, stderr


@functools.lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """Why this host cannot run the python tool's sandbox, or None when it can (one trial run)."""
    try:
        code, out, err = run_sandboxed("print(1)", 60.0, tmp_mb=1)
    except (SandboxUnavailable, OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None if (code, out) == (0, "1\n") else f"a trial program gave exit code {code}: {(out + err)[-300:]}"


@register_tool("python")
def python(code: str) -> str:
    """Run a Python 3 program and return what it printed (stdout, then stderr).

    Args:
        code: the program; print the values you need
    """
    # The time limit is the config's (agent.tool_timeout_s, passed by the runner), never the model's: a
    # timeout_s argument in the schema let the policy give its own code as long as it liked.
    timeout_s = max(0.5, float(os.environ.get(TIMEOUT_ENV, "5")) - 0.5)
    # What the sandbox isolates and what it does not: docs/agent.md, mrl/agent/sandbox.py. A host that
    # cannot build it is refused by mrl plan; here the code is never run outside it.
    try:
        status, out, err = run_sandboxed(code, timeout_s)
    except subprocess.TimeoutExpired:
        return f"error: the program ran longer than {timeout_s:g} s and was killed"
    except SandboxUnavailable as e:
        raise RuntimeError(f"the python tool's sandbox could not be built on this host ({e}); the code was not run") from None
    text = out + (("\n" if out else "") + err if err else "")
    if status > 128 and status - 128 in _SIGNALS:
        text += f"\n(the program was stopped: {_SIGNALS[signal.Signals(status - 128)]})"
    elif status:
        text += f"\n(exit code {status})"
    return text[-PYTHON_OUTPUT_CHARS:] if len(text) > PYTHON_OUTPUT_CHARS else text
