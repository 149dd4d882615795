"""The driver's side of the generative judge (``reward.judge``, docs/judge.md): its engines and its
place in the reward phase, in training and validation.

* :class:`JudgeEngines` — ``reward.judge.engines`` servers of ``reward.judge.model``, each started by
  the rollout engines' launcher (``RemoteEngine``: a Ray actor owning the server process) in the
  placement bundle of rollout engine ``i mod n`` — on its node and, on GPU, its device. The embedded
  engine on CPU (and with rollout.engine=torch), SGLang on GPU with rollout.engine=sglang; bound to
  rollout.host (loopback by default) with the run's control token, as the rollout engines.
* :class:`Judge` — the run's reward scorer (``SampleScorer``, mrl/driver/scoring.py: the step and validation
  call it as they call any other); per batch: decode each sample's prompt, render, ask the judge (concurrently, with
  timeouts and retries), parse, then combine per ``reward.judge.combine``:

      combine=judge:    reward_i = judge_score_i   (reward.function only reported: rule_score, acc, and
                        judge_rule_agreement_i = [judge_score_i >= 0.5] == [rule_score_i >= 0.5])
      combine=function: reward_i = f(..., extra_info_i + {"judge_score": judge_score_i})

  A sample whose verdict did not come or did not parse follows ``reward.on_error`` (raise / 0 /
  masked out of the loss) and is counted in ``reward/judge_unparsed`` or ``reward/judge_errors``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mrl.config import MRLConfig
from mrl.config.validate_judge import judge_port_base
from mrl.driver.scoring import Rule, Samples, SampleScorer
from mrl.errors import UnsupportedConfigError
from mrl.observability.timer import timer
from mrl.rewards.judge import JudgeResult, JudgeScorer
from mrl.rewards.manager import RewardResult

log = logging.getLogger(__name__)


class JudgeEngines:
    """The judge's servers (module doc); ``stop`` ends them. ``engine_set``: the run's ``EngineSet``."""

    def __init__(self, cfg: MRLConfig, plan: Any, workers: Any, engine_set: Any) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from mrl.driver.engines import TOKEN_ENV, EngineSlot, RemoteEngine

        j, r = cfg.reward.judge, cfg.rollout
        pg = engine_set.own_pg or workers.pg
        self.token = engine_set.token
        self.engines: list[Any] = []
        try:
            for i in range(j.engines):
                near = engine_set.slots[i % len(engine_set.slots)]
                port = judge_port_base(cfg) + i
                slot = EngineSlot(i, near.node_id, near.node_ip, near.gpu_ids[:1], near.bundle,
                                  near.url.rsplit(":", 1)[0] + f":{port}", port)
                cmd, env = judge_command(cfg, slot, self.token, TOKEN_ENV)
                e = RemoteEngine(slot, cmd, env, plan.log_dir.resolve() / f"judge_{i}.log", r.engine_startup_timeout_s,
                                 PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                  placement_group_bundle_index=near.bundle),
                                 cuda=bool(slot.gpu_ids))
                self.engines.append(e)
                e.start()
            for e in self.engines:
                e.wait_healthy()
        except BaseException:
            self.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def stop(self) -> None:
        for e in self.engines:
            try:
                e.stop()
            except Exception as ex:  # noqa: BLE001 - stop the others anyway
                log.warning("could not stop judge engine %s: %s", e.url, ex)
        self.engines = []


def judge_command(cfg: MRLConfig, slot: Any, token: str | None, token_env: str) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of one judge server: the rollout engines' command builders with the judge's model."""
    from mrl.rollout.sglang_launcher import (
        SGLangLaunchSpec,
        build_embedded_command,
        build_sglang_command,
    )

    j, r = cfg.reward.judge, cfg.rollout
    cuda = bool(slot.gpu_ids)
    device = "cuda" if cuda else "cpu"
    if cuda and r.engine == "sglang":
        return build_sglang_command(SGLangLaunchSpec(
            model_path=str(j.model), port=slot.port, host=r.host, mem_fraction_static=j.mem_fraction_static,
            base_gpu_id=slot.gpu_ids[0], dtype=cfg.model.compute_dtype(device), random_seed=cfg.trainer.seed,
            admin_api_key=token)), {}
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **({token_env: token} if token else {})}
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = str(slot.gpu_ids[0])
    return build_embedded_command(str(j.model), slot.port, host=r.host, token_env=token_env if token else None,
                                  device=device, dtype=cfg.model.compute_dtype(device), seed=cfg.trainer.seed), env


def external_token(cfg: MRLConfig) -> str | None:
    """The bearer token of ``reward.judge.url`` from the environment variable ``reward.judge.token_env``."""
    name = cfg.reward.judge.token_env
    if name is None:
        return None
    token = os.environ.get(name)
    if not token:
        raise UnsupportedConfigError(f"reward.judge.token_env={name}: that environment variable is empty or unset in the "
                                     f"driver's environment; fix: export {name}=<the API key of reward.judge.url="
                                     f"{cfg.reward.judge.url}>")
    return token


class Judge(SampleScorer):
    """The judge phase of the reward (module doc), the run's reward scorer (mrl/driver/scoring.py) when
    reward.judge.enable; ``engines`` None for an external url."""

    def __init__(self, cfg: MRLConfig, scorer: JudgeScorer, tokenizer: Any, engines: JudgeEngines | None = None) -> None:
        self.cfg, self.scorer, self.tokenizer, self.engines = cfg, scorer, tokenizer, engines

    def train(self, samples: Samples, rule: Rule, metrics: dict[str, float]) -> RewardResult:
        with timer("judge", metrics):
            out = self(samples.prompts, samples.texts, rule, samples.extra_infos, metrics)
        metrics.update(out.fault_metrics())  # reward/errors, reward/timeouts, reward/zeroed_samples
        return out

    def validate(self, samples: Samples, rule: Rule) -> tuple[RewardResult, dict[str, torch.Tensor]]:
        return self(samples.prompts, samples.texts, rule, samples.extra_infos), {}

    def __call__(self, prompts: Sequence[Any], texts: Sequence[str], rule: Callable[[list], RewardResult],
                 extra_infos: Sequence[dict | None], m: dict[str, float] | None = None) -> RewardResult:
        """Rewards of the samples (``prompts``: their Prompt records, ``texts``: decoded responses); ``rule(extra)``
        calls reward.function; ``m`` (training) gets the judge's metrics."""
        j, on_error = self.cfg.reward.judge, self.cfg.reward.on_error
        shown = [self.tokenizer.decode(p.prompt_ids, skip_special_tokens=True) for p in prompts]
        res = self.scorer(shown, list(texts), [p.ground_truth for p in prompts])
        if m is not None:
            m |= res.metrics()
        valid = apply_fault_policy(res, on_error)
        if j.combine == "function":
            out = rule([{**(e or {}), "judge_score": float(s)} for e, s in zip(extra_infos, res.scores, strict=True)])
            errors = [je or fe for je, fe in zip(res.errors, out.errors, strict=True)]
            return dataclasses.replace(out, valid=out.valid & valid, errors=errors, token_level_scores=None,
                                       extra={**out.extra, "judge_score": res.scores.tolist()})
        extra: dict[str, list] = {}
        if j.report_rule:  # logged next to the judge's score, never trained on
            ruled = rule(list(extra_infos))
            extra = {k: v for k, v in ruled.extra.items() if k != "score"}
            extra.setdefault("acc", ruled.scores.tolist())
            extra["rule_score"] = ruled.scores.tolist()
            agree = ((res.scores >= 0.5) == (ruled.scores >= 0.5)).float()  # a pass = a score >= 0.5, for both
            extra["judge_rule_agreement"] = agree.tolist()
            if m is not None:
                m["reward/rule_score"] = float(ruled.scores.mean())
                ok = torch.tensor([e is None for e in res.errors], dtype=torch.bool)
                m["reward/judge_rule_agreement"] = float(agree[ok].mean()) if bool(ok.any()) else float("nan")
        extra["judge_score"] = res.scores.tolist()
        return RewardResult(res.scores.clone(), valid, None, list(res.errors), extra)

    def close(self) -> None:
        self.scorer.close()
        if self.engines is not None:
            self.engines.stop()


def apply_fault_policy(res: JudgeResult, on_error: str) -> torch.Tensor:
    """reward.on_error for the samples the judge failed on: raise (RuntimeError with the first failure and
    the fix), zero (score 0, kept: [B] all True), mask ([B] False where it failed). Never silent: a warning
    with the counts under zero and mask."""
    bad = [i for i, e in enumerate(res.errors) if e is not None]
    B = len(res.errors)
    if not bad:
        return torch.ones(B, dtype=torch.bool)
    first = f"sample {bad[0]}: {res.errors[bad[0]][:300]}"
    if on_error == "raise":
        raise RuntimeError(f"the judge failed on {len(bad)} of {B} samples ({res.unparsed} unparsable verdicts, "
                           f"{res.failed} without an answer); first, {first}; fix: reward.judge.parse / prompt_template "
                           "(unparsable), reward.judge.timeout_s / engines (no answer), or reward.on_error=zero|mask "
                           "to continue past failures")
    log.warning("the judge failed on %d of %d samples (reward.on_error=%s: %s); first, %s", len(bad), B, on_error,
                "score 0" if on_error == "zero" else "masked out of the loss", first)
    if on_error == "zero":
        return torch.ones(B, dtype=torch.bool)
    return torch.tensor([e is None for e in res.errors], dtype=torch.bool)


def start_judge(cfg: MRLConfig, plan: Any, workers: Any, engine_set: Any, tokenizer: Any) -> Judge | None:
    """reward.judge.enable: its engines (model) or its external server's token (url), and the phase's callable."""
    j = cfg.reward.judge
    if not j.enable:
        return None
    if j.url is not None:
        scorer = JudgeScorer.from_config(j, [j.url], external_token(cfg),
                                         token_source=f"the environment variable {j.token_env}" if j.token_env
                                         else "reward.judge.token_env (unset)", seed=cfg.trainer.seed)
        return Judge(cfg, scorer, tokenizer)
    engines = JudgeEngines(cfg, plan, workers, engine_set)
    log.info("judge: %d engine(s) of %s at %s", len(engines.urls), j.model, ", ".join(engines.urls))
    return Judge(cfg, JudgeScorer.from_config(j, engines.urls, None, seed=cfg.trainer.seed), tokenizer, engines)
