"""Hermes tool-call parsing, tool schemas from signatures + docstrings, the python sandbox tool,
and the agent config's up-front refusals."""
import asyncio
import json

import pytest

from mrl.agent.builtin_tools import sandbox_problem
from mrl.agent.parser import parse_tool_calls
from mrl.agent.runner import ERROR, OK, ToolRunner
from mrl.agent.tools import function_schema, load_tools
from mrl.config import ConfigError, load_config
from mrl.config.agent import AgentConfig


def test_hermes_calls_in_order_with_string_arguments_and_faults():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> and '
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    a, b = parse_tool_calls(text)
    assert (a.name, a.arguments, a.error) == ("calculator", {"expression": "1+2"}, None)
    assert (b.name, b.arguments, b.error) == ("python", {"code": "print(1)"}, None)
    assert parse_tool_calls("just an answer: 42") == []
    bad_json, = parse_tool_calls('<tool_call>{"name": calc}</tool_call>')
    assert bad_json.error.startswith("the tool call is not valid JSON")
    no_name, = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')
    assert "JSON object" in no_name.error
    bad_args, = parse_tool_calls('<tool_call>{"name": "c", "arguments": [1]}</tool_call>')
    assert bad_args.name == "c" and "got list" in bad_args.error
    ok, cut = parse_tool_calls('<tool_call>{"name": "c"}</tool_call> <tool_call>{"name": "c", "argu')
    assert ok.error is None and ok.arguments == {} and "not closed" in cut.error
    with pytest.raises(ValueError, match="agent.format='xml'"):
        parse_tool_calls("x", "xml")


def lookup(city: str, days: int = 1, metric: bool = True, _secret: str = "") -> str:
    """Look up the weather.

    More text that is not the first paragraph.

    Args:
        city: the city's name,
            over two lines
        days: how many days
    Returns:
        text
    """
    return city


def test_schema_from_signature_and_docstring():
    s = function_schema(lookup, "lookup")
    assert s == {"type": "function", "function": {
        "name": "lookup", "description": "Look up the weather. More text that is not the first paragraph.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "the city's name, over two lines"},
            "days": {"type": "integer", "description": "how many days"},
            "metric": {"type": "boolean"}}, "required": ["city"]}}}
    calc = load_tools(["calculator"])["calculator"]
    assert calc.schema["function"]["parameters"]["required"] == ["expression"]

    def untyped(x):
        """Doc."""
    with pytest.raises(ValueError, match="'x' has no type annotation"):
        function_schema(untyped, "untyped")


def test_agent_config_refuses_unknown_tool_bad_format_and_no_turns(tmp_path):
    with pytest.raises(ValueError, match="unknown tool 'calculater'; did you mean 'calculator'"):
        AgentConfig(tools=["calculater"])
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        AgentConfig(format="xml")
    with pytest.raises(ValueError, match="max_turns"):
        AgentConfig(max_turns=0)
    f = tmp_path / "t.py"
    f.write_text("def nodoc(x: int) -> str:\n    return str(x)\n")
    with pytest.raises(ConfigError, match=r"agent.tools\[1\]=.*no docstring"):
        load_config(None, ["agent.enable=true", f"agent.tools=[calculator,{f}:nodoc]"])
    with pytest.raises(ConfigError, match="on-policy only"):
        load_config(None, ["agent.enable=true", "trainer.async_training.max_staleness=1"])


def test_python_tool_runs_code_without_network():
    runner = ToolRunner(workers=1, timeout_s=120.0, memory_mb=512)
    code = ("import os, socket\nprint(os.getcwd())\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('NET')\n"
            "except OSError as e:\n    print('no network', type(e).__name__)\n")

    async def go():
        try:
            return await runner.call("python", {"code": code}), await runner.call("python", {"code": "1/0"})
        finally:
            await runner.aclose()
    out, err = asyncio.run(go())
    if sandbox_problem() is not None:  # the tool refuses to run rather than run outside its sandbox
        assert out.status == ERROR and "sandbox could not be built" in out.text and "not run" in out.text
        return
    assert out.status == OK and out.text.splitlines() == ["/tmp", "no network OSError"], out.text
    assert "ZeroDivisionError" in err.text and "exit code 1" in err.text
    json.dumps(out.text)
