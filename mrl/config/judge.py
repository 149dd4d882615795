"""``reward.judge``: a generative reward model (LLM-as-judge; docs/judge.md).

Each sample's judge prompt is ``prompt_template`` rendered with the sample's decoded prompt text
(``{prompt}``), its decoded response (``{response}``) and its ground truth (``{ground_truth}``); a
judge model writes a verdict, which ``parse`` turns into a score:

    score_i = scores[verdict_i]   (parse.scores set: e.g. {yes: 1.0, no: 0.0})
    score_i = float(verdict_i)    (parse.scores null: the verdict is a number)

where verdict_i is the first (or the named ``verdict``) group of ``parse.pattern`` (``type: regex``)
or the value at the dotted ``parse.key`` of the answer read as JSON (``type: json``). A verdict that
does not parse (or an answer that never came) is counted (``reward/judge_unparsed``,
``reward/judge_errors``) and goes to ``reward.on_error`` like a failing reward function: raise, 0, or
masked out of the loss — never a silent 0.

The judge runs on ``engines`` servers of its own model (``model``: the embedded engine on CPU,
rollout.engine on GPU, started next to the rollout engines, loopback + the run's control token) or
behind an external OpenAI-compatible ``url`` (its bearer token read from the environment variable
``token_env``, never from the YAML).
"""
from __future__ import annotations

import string
from typing import Literal

from pydantic import Field

from mrl.config.base import Section
from mrl.config.side_model import SideModelConfig

PLACEHOLDERS = ("prompt", "response", "ground_truth")
DEFAULT_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {ground_truth}\n\nStudent answer:\n{response}\n\n"
                    "Is the student answer correct? Reply yes or no.\nVerdict:")


class JudgeParseConfig(Section):
    """How a judge's answer becomes a score (module doc)."""

    type: Literal["regex", "json"] = Field("regex", description="regex: the verdict is the first group (or the "
                                           "group named 'verdict') of pattern's first match; json: the answer is "
                                           "a JSON object and the verdict its value at key.")
    pattern: str = Field(r"(?i)\b(yes|no)\b", description="type=regex: Python regex with at least one group.")
    key: str = Field("score", description="type=json: dotted path of the verdict in the answer's JSON object, "
                     "e.g. 'verdict' or 'result.score'.")
    scores: dict[str, float] | None = Field(
        default_factory=lambda: {"yes": 1.0, "no": 0.0},
        description="verdict -> score (compared after strip() and lower()); null = the verdict is a number.")


class JudgeConfig(SideModelConfig):
    """The judge model (a side model served by engines, mrl/config/side_model.py), its prompt, its parser, its
    engines and how its score becomes the reward."""

    enable: bool = Field(False, description="Score every sample with the judge (phase judge, in training and validation).")
    model: str | None = Field(None, description="HF causal-LM checkpoint directory of the judge, served by "
                              "`engines` engines of its own; null with url.")
    url: str | None = Field(None, description="Base URL of an external OpenAI-compatible server (e.g. "
                            "https://host/v1's parent: requests go to {url}/v1/completions or /v1/chat/completions); "
                            "null with model.")
    token_env: str | None = Field(None, description="url only: name of the environment variable holding the bearer "
                                  "token sent as 'Authorization: Bearer <token>' (never put the token in the YAML).")
    served_model: str = Field("default", description="The 'model' field of every request (an external server's "
                              "model name; the judge engines serve any name).")
    api: Literal["completions", "chat"] = Field(
        "completions", description="completions: the rendered template is the raw prompt (/v1/completions, "
        "batch_size prompts per request); chat: it is one user message (/v1/chat/completions, the judge's chat "
        "template, one conversation per request).")
    prompt_template: str = Field(DEFAULT_TEMPLATE, description="Judge prompt with the placeholders {prompt}, "
                                 "{response} and {ground_truth} ({{ and }} for literal braces).")
    parse: JudgeParseConfig = Field(default_factory=JudgeParseConfig, description="Verdict -> score.")
    engines: int = Field(1, ge=1, description="model only: judge engines, started next to the rollout engines.")
    port_base: int | None = Field(None, ge=1024, le=65000, description="model only: judge engine i listens on "
                                  "port_base + i (null: rollout.port_base + 100).")
    mem_fraction_static: float = Field(0.1, gt=0, lt=1, description="model on GPU with rollout.engine=sglang: the "
                                       "judge's share of its device (SGLang's --mem-fraction-static).")
    max_new_tokens: int = Field(16, ge=1, description="Tokens of one verdict.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of the verdicts (0 = greedy).")
    timeout_s: float = Field(60.0, gt=0, description="Seconds one request may take; a timed-out request is retried, "
                             "then its samples count as judge errors (reward.on_error).")
    max_retries: int = Field(2, ge=0, description="Retries of a request that failed (connection, 5xx, timeout); "
                             "4xx is not retried.")
    max_concurrency: int = Field(8, ge=1, description="Requests in flight at once, over all judge servers.")
    batch_size: int = Field(32, ge=1, description="api=completions: prompts per request.")
    combine: Literal["judge", "function"] = Field(
        "judge", description="judge: the judge's score is the reward; function: reward.function's score is, "
        "and it reads the judge's as extra_info['judge_score'] (as reward_model.combine=function).")
    report_rule: bool = Field(True, description="combine=judge: reward.function is still called, its score logged "
                              "as rule_score (and as acc when it returns no acc), never trained on; false = not "
                              "called (tasks without a rule).")


    def model_dir(self) -> str | None:
        return self.model  # None behind an external url


def template_fields(template: str) -> list[str]:
    """The placeholders of ``template``; ValueError for a malformed one (unbalanced braces)."""
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
