"""The built-in tools: ``calculator`` (exact arithmetic on an expression) and ``python`` (run a
snippet in a sandboxed interpreter). Both run inside a tool worker subprocess (mrl/agent/runner.py),
under its memory limit and per-call timeout.
"""
from __future__ import annotations

import ast
import operator
import os
import resource
import shutil
import subprocess
import sys
import tempfile

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


#: the network isolation the python tool needs: a new user + network namespace (no interfaces but lo)
UNSHARE = ("unshare", "--user", "--map-root-user", "--net")
PYTHON_OUTPUT_CHARS = 4000


def network_isolation_available() -> bool:
    """True when ``unshare`` can create a user + network namespace here (unprivileged user namespaces)."""
    if shutil.which(UNSHARE[0]) is None:
        return False
    try:
        return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


TIMEOUT_ENV = "MRL_TOOL_TIMEOUT_S"  # set by mrl/agent/runner.py in every worker: the call's limit


@register_tool("python")
def python(code: str) -> str:
    """Run a Python 3 program and return what it printed (stdout, then stderr).

    Args:
        code: the program; print the values you need
    """
    # The time limit is the config's (agent.tool_timeout_s, passed by the runner), never the model's: a
    # timeout_s argument in the schema let the policy give its own code as long as it liked.
    timeout_s = max(0.5, float(os.environ.get(TIMEOUT_ENV, "5")) - 0.5)
    # What this isolates (docs/agent.md): no network (a fresh network namespace: only a down
    # loopback), a fresh temporary working directory (removed afterwards), an empty environment,
    # `python -I` (no user site, no PYTHON* variables), the worker's memory limit (RLIMIT_AS is
    # inherited) and a CPU-time limit. What it does NOT: the filesystem is the host's, readable and
    # writable wherever this user may write (no mount namespace or seccomp); run untrusted code in a
    # container or VM.
    if not network_isolation_available():
        raise RuntimeError("the python tool needs network isolation (`unshare --user --net`), which this host does "
                           "not allow (unprivileged user namespaces are off); the code was not run")
    with tempfile.TemporaryDirectory(prefix="mrl-python-tool-") as cwd:
        cpu = max(1, int(timeout_s) + 1)

        def limit_cpu() -> None:  # in the child, before exec (the worker is single-threaded)
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        try:
            r = subprocess.run([*UNSHARE, sys.executable, "-I", "-c", code], cwd=cwd, env={"PATH": os.defpath},
                               capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                               preexec_fn=limit_cpu, check=False)
        except subprocess.TimeoutExpired:
            return f"error: the program ran longer than {timeout_s} s and was killed"
    out = r.stdout + (("\n" if r.stdout else "") + r.stderr if r.stderr else "")
    if r.returncode:
        out += f"\n(exit code {r.returncode})"
    return out[-PYTHON_OUTPUT_CHARS:] if len(out) > PYTHON_OUTPUT_CHARS else out
