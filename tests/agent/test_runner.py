"""Tool worker pool: results, and every fault (raise, hang, junk, memory, death) as an error message
for the model that leaves the pool serving (docs/agent.md, "Tool contract")."""
import asyncio
import time
from pathlib import Path

import pytest

from mrl.agent.runner import ERROR, OK, TIMEOUT, ToolRunner

TOOLS = str(Path(__file__).with_name("faulty_tools.py"))


def _run(runner: ToolRunner, calls):
    async def go():
        try:
            return await asyncio.gather(*(runner.call(f"{TOOLS}:{fn}", args, **kw) for fn, args, kw in calls))
        finally:
            await runner.aclose()
    return asyncio.run(go())


def test_results_and_every_fault_become_tool_messages():
    runner = ToolRunner(workers=2, timeout_s=120.0, memory_mb=256)
    out = _run(runner, [
        ("echo", {"text": "hi"}, {}),
        ("as_json", {"x": 3}, {}),
        ("boom", {"x": 1}, {}),
        ("hang", {"x": 1}, {"timeout_s": 2.0}),
        ("junk", {"x": 1}, {}),
        ("hog", {"mb": 1024}, {}),
        ("die", {"x": 1}, {}),
        ("echo", {"wrong": 1}, {}),  # arguments that do not fit the signature
        ("calc_missing", {}, {}),    # no such function in the file
        ("echo", {"text": "still serving"}, {}),
    ])
    status = [o.status for o in out]
    assert status == [OK, OK, ERROR, TIMEOUT, ERROR, ERROR, ERROR, ERROR, ERROR, OK]
    assert out[0].text == "hi"  # the tool's print went to stderr, not into the protocol
    assert out[1].text == '{"x": 3, "squares": [9]}'
    assert "ValueError: bad x=1" in out[2].text
    assert "did not finish within 2 s" in out[3].text
    assert "set" in out[4].text and "str or a JSON value" in out[4].text
    assert "MemoryError" in out[5].text or "died" in out[5].text
    assert "exit code 3" in out[6].text
    assert "TypeError" in out[7].text and "wrong" in out[7].text
    assert "calc_missing" in out[8].text
    assert out[9].text == "still serving"


def test_a_hung_worker_is_replaced_and_calls_are_bounded():
    runner = ToolRunner(workers=1, timeout_s=120.0, memory_mb=256)
    out = _run(runner, [("hang", {"x": 1}, {"timeout_s": 1.0}), ("echo", {"text": "after"}, {})])
    assert [o.status for o in out] == [TIMEOUT, OK] and out[1].text == "after"
    assert not runner._all  # aclose killed every worker


def test_builtin_calculator_in_a_worker():
    runner = ToolRunner(workers=1, timeout_s=120.0, memory_mb=256)

    async def go():
        try:
            return [await runner.call("calculator", {"expression": e}) for e in ("4821 * 37", "7 / 2", "2 ** 99999", "__import__('os')")]
        finally:
            await runner.aclose()
    ok, half, big, evil = asyncio.run(go())
    assert (ok.status, ok.text) == (OK, "178377") and half.text == "3.5"
    assert big.status == ERROR and "exponent" in big.text
    assert evil.status == ERROR and "unsupported syntax" in evil.text


def test_an_out_of_range_memory_limit_is_refused_up_front():
    """Issue 45 item 5: a limit setrlimit cannot take is named when the runner is built, not as "a tool worker did
    not start within 120 s" at every call."""
    with pytest.raises(ValueError) as e:
        ToolRunner(workers=1, timeout_s=5.0, memory_mb=10**13)
    msg = str(e.value)
    assert "agent.tool_memory_mb=10000000000000" in msg and "RLIMIT_AS" in msg and "does not fit" in msg, msg
    assert "fix:" in msg


def test_a_worker_that_dies_at_start_is_reported_at_once_with_its_error():
    """A worker whose setrlimit fails (the limit reached it without the runner's check) exits before it is ready: the
    call says so at once, with the key, the value and the OS error, instead of waiting out the startup timeout."""
    runner = ToolRunner(workers=1, timeout_s=5.0, memory_mb=256, startup_timeout_s=60.0)
    runner.memory_mb = 10**13
    t0 = time.monotonic()
    (out,) = _run(runner, [("echo", {"text": "hi"}, {})])
    assert time.monotonic() - t0 < 30
    assert out.status == ERROR and "exited at start with exit code 3" in out.text, out.text
    assert "agent.tool_memory_mb=10000000000000" in out.text and "OverflowError" in out.text, out.text
    assert "did not start within" not in out.text and "Traceback" not in out.text
