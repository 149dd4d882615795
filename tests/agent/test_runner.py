"""Tool worker pool: results, and every fault (raise, hang, junk, memory, death) as an error message
for the model that leaves the pool serving (docs/agent.md, "Tool contract")."""
import asyncio
from pathlib import Path

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
