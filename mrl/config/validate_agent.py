"""Plan-time check of an agent run's prompt budget: the chat template renders the tools' JSON schemas into every
prompt (transformers' ``apply_chat_template(tools=...)``), so a prompt's tokens are

    len(prompt with tools) = len(prompt) + schema overhead            (must stay <= data.max_prompt_length)

A schema overhead that alone fills ``data.max_prompt_length`` drops every prompt as overlong at load ("no prompts
left", after the plan had passed: issue 53). Measured with model.path's own tokenizer and template on a one-token
question, when the tokenizer is on this host (else ``mrl train``'s dataset load reports it, before Ray)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mrl.config.root import MRLConfig


def check_tool_prompt_room(cfg: MRLConfig, schemas: list[dict], errors: list[str]) -> None:
    path = cfg.model.path
    if not path or not (Path(path) / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    from mrl.data.tokenize import encode_prompt, has_chat_template

    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=cfg.model.trust_remote_code)
    except Exception:  # noqa: BLE001 - a tokenizer that does not load is train_preflight's error, with its cause
        return
    if not has_chat_template(tok):
        return  # the driver refuses agent.enable without a template that renders tools (agent/template.py)
    question = [{"role": "user", "content": "1"}]
    try:
        with_tools, plain = len(encode_prompt(tok, question, schemas)), len(encode_prompt(tok, question))
    except Exception:  # noqa: BLE001 - a template that fails on tools is refused at build with its own message
        return
    budget = cfg.data.max_prompt_length
    if with_tools >= budget:
        errors.append(f"agent.tools={cfg.agent.tools}: model.path's chat template renders the tools' schemas into every "
                      f"prompt ({with_tools - plain} tokens; {with_tools} with a one-token question), which fills "
                      f"data.max_prompt_length={budget}: every prompt would be dropped as overlong; fix: "
                      f"data.max_prompt_length well above {with_tools} (the schemas plus your longest question), or "
                      "fewer agent.tools")
