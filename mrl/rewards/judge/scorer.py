"""Judge prompts from samples, verdicts from the judge's servers, scores from the verdicts.

    judge_prompt_i = prompt_template.format(prompt=p_i, response=y_i, ground_truth=g_i)
    score_i        = parse(client(judge_prompt_i))            (mrl/rewards/judge/parse.py)

A sample whose answer did not come (timeout, connection, HTTP error) or did not parse keeps score 0
and an error string: :class:`JudgeResult` counts both, and the driver applies reward.on_error.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mrl.rewards.judge.client import JudgeClient
from mrl.rewards.judge.parse import UnparsableVerdict, parse_verdict


def render(template: str, prompt: str, response: str, ground_truth: Any) -> str:
    """The judge prompt of one sample (placeholders checked at plan time: mrl/config/judge.py)."""
    return template.format(prompt=prompt, response=response, ground_truth="" if ground_truth is None else ground_truth)


@dataclass
class JudgeResult:
    """Scores of B samples; ``errors[i]`` None when sample i's verdict parsed."""

    scores: torch.Tensor          # [B] float32, 0 where errors[i] is set
    errors: list[str | None]      # [B]
    verdicts: list[str | None]    # [B] the judge's raw answers (None when none came)

    @property
    def unparsed(self) -> int:
        """Answers that came but held no verdict."""
        return sum(e is not None and e.startswith("UnparsableVerdict") for e in self.errors)

    @property
    def failed(self) -> int:
        """Answers that never came (timeouts, connection or HTTP errors)."""
        return sum(e is not None for e in self.errors) - self.unparsed

    def metrics(self) -> dict[str, float]:
        """``reward/judge_score`` (mean over the parsed verdicts), ``reward/judge_unparsed``, ``reward/judge_errors``."""
        ok = torch.tensor([e is None for e in self.errors], dtype=torch.bool)
        mean = float(self.scores[ok].mean()) if bool(ok.any()) else float("nan")
        return {"reward/judge_score": mean, "reward/judge_unparsed": float(self.unparsed),
                "reward/judge_errors": float(self.failed)}


class JudgeScorer:
    """``reward.judge``'s template and parser over a :class:`JudgeClient`."""

    def __init__(self, cfg: Any, client: JudgeClient) -> None:
        self.cfg, self.client = cfg, client
        p = cfg.parse
        self._parse = {"type": p.type, "pattern": re.compile(p.pattern), "key": p.key, "scores": p.scores}

    @classmethod
    def from_config(cls, cfg: Any, urls: Sequence[str], token: str | None, token_source: str = "",
                    seed: int | None = 0) -> JudgeScorer:
        return cls(cfg, JudgeClient(urls, api=cfg.api, token=token, token_source=token_source, model=cfg.served_model,
                                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                    timeout_s=cfg.timeout_s, max_retries=cfg.max_retries,
                                    max_concurrency=cfg.max_concurrency, batch_size=cfg.batch_size, seed=seed))

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[Any]) -> JudgeResult:
        texts = [render(self.cfg.prompt_template, p, r, g) for p, r, g in zip(prompts, responses, ground_truths, strict=True)]
        answers = self.client.generate(texts)
        scores = torch.zeros(len(texts), dtype=torch.float32)
        errors: list[str | None] = []
        verdicts: list[str | None] = []
        for i, a in enumerate(answers):
            if isinstance(a, Exception):
                errors.append(f"{type(a).__name__}: {a}")
                verdicts.append(None)
                continue
            verdicts.append(a)
            try:
                scores[i] = parse_verdict(a, **self._parse)
                errors.append(None)
            except UnparsableVerdict as e:
                errors.append(f"UnparsableVerdict: {e} (answer {a[:120]!r})")
        return JudgeResult(scores, errors, verdicts)

    def close(self) -> None:
        self.client.close()
