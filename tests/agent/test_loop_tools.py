"""The loop's tool plumbing without an engine: a scripted /generate answer (SGLang's shape) carries
the model's calls; row tool kwargs reach the call, a relative file.py tool is found from the worker's
temporary directory, unknown tools and malformed calls become error messages the model reads."""
import asyncio
import os
import shutil

from transformers import PreTrainedTokenizerFast

from mrl.agent.loop import AgentClient
from mrl.agent.tools import load_tools
from mrl.config.agent import AgentConfig
from mrl.quickstarts.agent import CHAT_TEMPLATE
from mrl.rollout.router import RouteOutcome
from mrl.rollout.types import RolloutRequest
from tests.helpers.tiny_tokenizer import build_tokenizer

TOOL = '''
def lookup(key: str, table: dict | None = None) -> str:
    """Look a key up in the row's table.

    Args:
        key: what to look up
    """
    return str((table or {}).get(key, "missing"))
'''


class ScriptedRouter:
    pool = None

    def __init__(self, turns):
        self.turns, self.payloads = turns, []

    async def generate(self, payload, rid, timeout_s):
        self.payloads.append(payload)
        ids = self.turns[len(self.payloads) - 1]
        return RouteOutcome({"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                             "weight_version": "3", "output_token_logprobs": [[-0.25, i, None] for i in ids]}},
                            "http://engine", 1, None)


class _Client:  # what AgentClient reads of a RolloutClient: its router
    def __init__(self, router):
        self.router = router


def test_row_kwargs_relative_file_tools_and_faults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tools.py").write_text(TOOL)
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"] + [2]
    turn1 = ids('<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
                '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>')
    turn2 = ids("done")
    router = ScriptedRouter([turn1, turn2])
    tools = load_tools(["my_tools.py:lookup"])
    assert "table" in tools["lookup"].schema["function"]["parameters"]["properties"]  # not hidden: it has a default
    agent = AgentClient(_Client(router), tok, tools, AgentConfig(enable=True, tools=["my_tools.py:lookup"]))
    assert os.path.isabs(agent.tools["lookup"].spec.rpartition(":")[0])

    async def run():
        try:
            return await agent.agenerate(RolloutRequest([[5, 6]], n=1, sampling_params={"max_new_tokens": 400},
                                                        tools_kwargs=[{"lookup": {"table": {"a": "found-it"}}}]))
        finally:
            await agent.runner.aclose()
    (s,) = asyncio.run(run()).samples
    calls = s.agent["tool_calls"]
    assert [(c["name"], c["status"]) for c in calls] == [("lookup", "ok"), ("search", "error"), ("", "error")]
    assert calls[0]["result"] == "found-it" and calls[0]["arguments"] == {"key": "a"}
    assert "unknown tool 'search'; available: lookup" in calls[1]["result"]
    assert "not valid JSON" in calls[2]["result"]
    assert s.agent["turns"] == 2 and s.agent["tool_errors"] == 2 and s.agent["final_response"] == "done"
    assert s.weight_version == "3" and s.token_weight_versions is None
    # the model's tokens with the engine's log-probs, the three tool messages as one masked segment
    assert s.response_ids[:len(turn1)] == turn1 and s.response_ids[-len(turn2):] == turn2
    seg = len(s.response_ids) - len(turn1) - len(turn2)
    assert s.loss_mask == [1] * len(turn1) + [0] * seg + [1] * len(turn2)
    assert s.rollout_log_probs == [-0.25] * len(turn1) + [0.0] * seg + [-0.25] * len(turn2)
    text = tok.decode(s.response_ids[len(turn1):len(turn1) + seg])
    assert text.startswith("\ntool: found-it\ntool: error: unknown tool") and text.endswith("\nassistant:")
    shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)
