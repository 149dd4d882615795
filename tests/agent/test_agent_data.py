"""Agent prompts: the tools reach the prompt through the chat template's tools= argument; verl's
multi-turn rows are checked; templates that cannot carry tools or tool messages are refused."""
import json

import pytest
from transformers import PreTrainedTokenizerFast

from mrl.agent.template import TemplateError, check_tools_template, tool_segment_text
from mrl.agent.tools import load_tools
from mrl.data.dataset import DataError, PromptDataset
from mrl.quickstarts.agent import CHAT_TEMPLATE
from tests.helpers.tiny_tokenizer import CHATML_TEMPLATE, build_tokenizer


def _tok(template):
    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>")
    tok.chat_template = template
    return tok


def _rows(tmp_path, *rows):
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


def test_tools_are_rendered_into_the_prompt_and_rows_are_checked(tmp_path):
    tok, schemas = _tok(CHAT_TEMPLATE), [t.schema for t in load_tools(["calculator", "python"]).values()]
    row = {"prompt": [{"role": "user", "content": "what is 2 * 3 ?"}], "reward_model": {"ground_truth": "6"},
           "extra_info": {"tools_kwargs": {"calculator": {"create_kwargs": {}}}}}
    ds = PromptDataset([_rows(tmp_path, row)], tok, max_prompt_length=256, tools=schemas)
    assert tok.decode(ds[0].prompt_ids) == "tools: calculator(expression) python(code)\n" \
                                          "user: what is 2 * 3 ?\nassistant:"
    with pytest.raises(DataError, match=r"rows.jsonl:1: column 'prompt' is a string"):
        PromptDataset([_rows(tmp_path, {**row, "prompt": "what is 2 * 3 ?"})], tok, tools=schemas)
    with pytest.raises(DataError, match=r"rows.jsonl:2: extra_info.tools_kwargs names tools \['search'\]"):
        PromptDataset([_rows(tmp_path, row, {**row, "extra_info": {"tools_kwargs": {"search": {}}}})], tok, tools=schemas)


def test_templates_without_tools_are_refused_and_segments_follow_the_template():
    schemas = [load_tools(["calculator"])["calculator"].schema]
    check_tools_template(_tok(CHAT_TEMPLATE), schemas)
    with pytest.raises(TemplateError, match="ignores its tools= argument"):
        check_tools_template(_tok(CHATML_TEMPLATE), schemas)
    with pytest.raises(TemplateError, match="has no chat_template"):
        check_tools_template(_tok(None), schemas)
    tok = _tok(CHAT_TEMPLATE)
    # the model stopped on </s>: the segment starts with the rest of the turn's end, then the tool turns
    assert tool_segment_text(tok, ["6", "error: x"], "</s>") == "\ntool: 6\ntool: error: x\nassistant:"
    assert tool_segment_text(tok, ["6"], None) == "</s>\ntool: 6\nassistant:"  # cut before its end-of-turn
