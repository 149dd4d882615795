"""Agent section: multi-turn, tool-calling rollouts (docs/agent.md).

With ``enable``, every rollout (training, validation) is an agent loop: the model may call the
``tools`` in ``format`` for up to ``max_turns`` turns; tool results are appended as tokens the loss
skips. Tools run in ``tool_workers`` subprocesses, each call within ``tool_timeout_s`` and
``tool_memory_mb``.
"""
from __future__ import annotations

from pydantic import Field, field_validator

from mrl.config.base import Section


class AgentConfig(Section):
    """Multi-turn tool calling in the rollout (verl ``actor_rollout_ref.rollout.multi_turn``)."""

    enable: bool = Field(False, description="Roll out multi-turn, tool-calling trajectories (the prompts must be chat messages).")
    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="Tools the model may call: built-in names (calculator, python) or 'path/to/file.py:fn' / 'pkg.module:fn'.")
    format: str = Field("hermes", description="Tool-call format in the model's text; hermes: <tool_call>{\"name\", \"arguments\"}</tool_call> (Qwen2.5/3).")
    max_turns: int = Field(4, ge=1, description="Most assistant turns per trajectory (the last one's tool calls are not run).")
    tool_timeout_s: float = Field(10.0, gt=0, le=3600, description="Seconds one tool call may run; then its worker is killed and the model reads an error.")
    tool_memory_mb: int = Field(1024, ge=64, le=1 << 20, description="Address-space limit (RLIMIT_AS, MiB) of a tool "
                                "worker process; at most 1 TiB (beyond it the limit overflows and every call fails to start).")
    tool_workers: int = Field(4, ge=1, le=256, description="Tool worker subprocesses (tool calls running at once).")
    max_tool_response_chars: int = Field(2000, ge=1, description="Tool results longer than this are cut (the model reads the start).")

    @field_validator("format")
    @classmethod
    def _check_format(cls, v: str) -> str:
        from mrl.agent.parser import FORMATS

        if v not in FORMATS:
            raise ValueError(f"unknown tool-call format {v!r}; fix: agent.format={' | '.join(FORMATS)}")
        return v

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, v: list[str]) -> list[str]:
        from mrl.agent.tools import builtin_names
        from mrl.plugins import closest, is_spec

        if not v:
            raise ValueError("no tools; fix: agent.tools=[calculator] (or your own path/to/file.py:fn)")
        if len(set(v)) != len(v):
            raise ValueError(f"{v} lists a tool twice; fix: list every tool once")
        for name in v:
            if not is_spec(name) and name not in builtin_names():
                raise ValueError(f"unknown tool {name!r}; {closest(name, builtin_names())}; "
                                 "or give your own as path/to/file.py:fn (docs/agent.md)")
        return v
