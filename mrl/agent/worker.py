"""A tool worker: ``python -m mrl.agent.worker --memory-mb M``; one JSON request per stdin line,
one JSON answer per line on the protocol pipe (mrl/agent/runner.py starts and feeds it).

Request: ``{"spec": "calculator" | "file.py:fn", "arguments": {...}}``. Answer: ``{"ok": "<text>"}``
or ``{"error": "<text>"}``. The tool's own prints go to stderr (the protocol's stdout is kept on a
private descriptor), its memory is capped by RLIMIT_AS, and its working directory is a temporary
directory of the worker. Imports no torch: a worker starts in a fraction of a second.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import traceback
from typing import Any

ERROR_CHARS = 1000


def memory_limit_problem(mb: int) -> str | None:
    """Why RLIMIT_AS cannot be set to ``mb`` MiB in this process (and so in a worker it starts), or None."""
    soft = mb * 1024 * 1024
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if soft >= 1 << 63:  # rlim_t's range as Python's resource module takes it
        return f"{mb} MiB = {soft} bytes does not fit an rlimit (at most {((1 << 63) - 1) >> 20} MiB)"
    if hard != resource.RLIM_INFINITY and soft > hard:
        return f"{mb} MiB is above this process's hard RLIMIT_AS of {hard >> 20} MiB (ulimit -v)"
    return None


def _limit_memory(mb: int) -> None:
    soft = mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (soft, resource.getrlimit(resource.RLIMIT_AS)[1]))


def as_text(value: Any) -> str:
    """The tool message of a return value: a str as is, a JSON value as its JSON text; anything else
    (a set, an object, NaN...) is the tool's error, reported to the model."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"the tool returned {type(value).__name__} ({e}); a tool must return a str or a JSON value") from None


def call(spec: str, arguments: dict[str, Any], cache: dict[str, Any]) -> dict[str, str]:
    from mrl.agent.tools import resolve_tool

    try:
        fn = cache.get(spec) or cache.setdefault(spec, resolve_tool(spec))
        return {"ok": as_text(fn(**arguments))}
    except MemoryError:
        return {"error": "MemoryError: the tool exceeded its memory limit (agent.tool_memory_mb)"}
    except Exception as e:  # noqa: BLE001 - any failure of user code becomes the tool message
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
        return {"error": f"{type(e).__name__}: {e}{where}"[:ERROR_CHARS]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--memory-mb", type=int, required=True)
    args = p.parse_args()
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # the answers; fd 1 becomes stderr for the tools' prints
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import mrl.agent.tools  # noqa: F401 - imported before the limit: the limit is for the tool's own memory
    try:
        _limit_memory(args.memory_mb)
    except (OSError, ValueError, OverflowError) as e:  # the runner reports this line instead of "did not start"
        proto.write(json.dumps({"startup_error": f"its memory limit agent.tool_memory_mb={args.memory_mb} failed in "
                                                 f"setrlimit(RLIMIT_AS): {type(e).__name__}: {e}"}) + "\n")
        return 3
    cache: dict[str, Any] = {}
    proto.write('{"ready": true}\n')  # the runner times calls from here, not from the interpreter's start
    for line in sys.stdin:
        try:
            req = json.loads(line)
            out = call(req["spec"], req["arguments"], cache)
        except Exception as e:  # noqa: BLE001 - a malformed request must not end the worker
            out = {"error": f"bad request to the tool worker: {e!r}"}
        proto.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
