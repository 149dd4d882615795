"""agent.tools whose rendered schemas fill data.max_prompt_length are refused by the plan (issue 53: the plan
passed, then every prompt was dropped as overlong at load, "no prompts left")."""
from __future__ import annotations

from pathlib import Path

import pytest

from mrl.config import check_config, load_config
from tests.config.conftest import TINY_QWEN2, write_hf_config
from tests.helpers.tiny_tokenizer import add_chat_template, save_tiny_tokenizer

# a template that writes the tools' schemas into a system turn, as Qwen's and Llama-3's do
TOOLS_TEMPLATE = (
    "{% if tools %}<s>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_with_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = write_hf_config(tmp_path_factory.mktemp("agent") / "m", {**TINY_QWEN2, "max_position_embeddings": 2048})
    save_tiny_tokenizer(d)
    add_chat_template(d, TOOLS_TEMPLATE)
    return d


def _errors(base_overrides: list[str], model: Path, *extra: str) -> list[str]:
    ov = [o for o in base_overrides if not o.startswith("model.path=")]
    return check_config(load_config(None, [*ov, f"model.path={model}", "agent.enable=true", *extra], check=False))[0]


def _tokens_with_tools(model: Path) -> int:
    """The reference: transformers renders the calculator's schema with the template and counts the tokens."""
    from transformers import AutoTokenizer

    from mrl.agent.tools import load_tools

    tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    schemas = [t.schema for t in load_tools(["calculator"]).values()]
    text = tok.apply_chat_template([{"role": "user", "content": "1"}], tools=schemas, add_generation_prompt=True,
                                   tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_tools_that_fill_the_prompt_budget_are_refused(model_with_template: Path, base_overrides: list[str]) -> None:
    n = _tokens_with_tools(model_with_template)
    assert 64 < n < 1024, n  # the schema is long against a short budget, and within the model's 2048 positions
    errors = _errors(base_overrides, model_with_template, f"data.max_prompt_length={n}")
    assert any(e.startswith("agent.tools=['calculator']: ") and f"{n} with a one-token question" in e
               and f"data.max_prompt_length={n}" in e and "fix:" in e for e in errors), errors
    errors = _errors(base_overrides, model_with_template, f"data.max_prompt_length={n + 1}")
    assert not [e for e in errors if "schemas" in e], errors
