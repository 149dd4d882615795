"""The validation phase (verl ``RayPPOTrainer._validate``): every val prompt answered
``rollout.val_kwargs.n`` times, scored like training samples, summarised with verl's names.

    val prompts (P, in chunks of data.val_batch_size) -> RolloutRequest(n = val_kwargs.n,
    sampling = val_kwargs) -> P·n answers -> reward manager -> per-sample ``reward`` and the
    scorer's dict keys (verl's reward_extra_info: ``acc``, ``pred``, ...) -> process_validation_metrics
    (uid = dataset row) -> val-core/… and val-aux/… metrics

The answers are scored by the run's scorer exactly as in training (``scorer``, mrl/driver/scoring.py:
reward.function alone, with the reward model, or with the judge), which may add variables of its own:
with a reward model its raw score, ``rm_score`` (val-aux/<data_source>/rm_score/mean@N), and when the
function also reports a rule verdict (``acc``), ``rm_rule_agree``, ``rm_fooled`` and ``rm_wrong_prob``
(per answer: the RM's verdict σ(rm_score) > 0.5 agrees with the rule's; the RM accepts an answer the
rule rejects; σ(rm_score) if the rule rejects it, else 0 — driver/rm_reward.rm_rule_agreement): the
RM's drift from the rule on the val answers; with the judge, its ``judge_score`` and the rule's.

A dict-returning scorer adds one metric variable per numeric key (``score`` included, as in verl),
``acc`` becomes the val-core variable, and ``pred`` is the vote of ``maj@k``.

With the defaults (do_sample=false, n=1) this is one greedy answer per prompt and the metric
``val-core/<data_source>/reward/mean@1``. Dependencies are passed in (no trainer object), so the
phase runs against any rollout client, e.g. one engine in a test.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mrl.driver.batch import (
    assemble_train_batch,
    decode_responses,
    repeat_prompts,
    tools_kwargs_of,
    with_agent_info,
)
from mrl.driver.dumps import GenerationRows
from mrl.driver.scoring import RuleScorer, Samples, SampleScorer
from mrl.driver.seeds import group_seeds
from mrl.driver.vision import request_inputs
from mrl.observability.val_metrics import (
    process_validation_metrics,
    validation_metric_dict,
)
from mrl.rewards.manager import RewardResult
from mrl.rollout.types import RolloutRequest, RolloutResult

GENERATIONS_SEED = 42  # verl's fixed shuffle seed: the same rows are logged at every validation


@dataclass
class ValidationResult:
    """What one validation produced."""

    metrics: dict[str, float]        # verl names, e.g. val-core/<data_source>/reward/mean@N
    generations: list[dict[str, Any]]  # trainer.log_val_generations rows: {"input", "output", "score"}
    num_prompts: int
    num_samples: int                 # num_prompts * val_kwargs.n
    samples: GenerationRows | None = None  # every sample, for trainer.validation_data_dir (keep_samples)


def val_sampling_params(val_kwargs: Any, max_new_tokens: int) -> dict[str, Any]:
    """SGLang sampling_params of the validation answers: greedy (temperature 0) unless
    ``do_sample``, then ``temperature``/``top_p``/``top_k`` of ``rollout.val_kwargs``."""
    if not val_kwargs.do_sample:
        return {"temperature": 0.0, "max_new_tokens": max_new_tokens}
    return {"temperature": val_kwargs.temperature, "top_p": val_kwargs.top_p, "top_k": val_kwargs.top_k,
            "max_new_tokens": max_new_tokens}


def prompt_chunks(num_prompts: int, val_batch_size: int | None) -> list[range]:
    """Dataset rows per request: all at once when ``val_batch_size`` is None (verl's advice: the
    engines schedule memory themselves), else consecutive chunks of ``val_batch_size`` PROMPTS."""
    size = val_batch_size or max(num_prompts, 1)
    return [range(i, min(i + size, num_prompts)) for i in range(0, num_prompts, size)]


def pick_generations(inputs: Sequence[str], outputs: Sequence[str], scores: Sequence[float],
                     k: int) -> list[dict[str, Any]]:
    """``k`` rows as verl picks them: sort (input, output, score) by input, shuffle with a fixed
    seed, take the first k — so successive validations show the same prompts."""
    if k <= 0:
        return []
    rows = sorted(zip(inputs, outputs, scores, strict=True), key=lambda r: r[0])
    order = np.random.RandomState(GENERATIONS_SEED).permutation(len(rows))
    return [{"input": rows[i][0], "output": rows[i][1], "score": float(rows[i][2])} for i in order[:k]]


def run_validation(*, generate: Callable[[RolloutRequest], RolloutResult], tokenizer: Any, dataset: Any,
                   reward: Any, rollout: Any,
                   val_batch_size: int | None = None, log_generations: int = 0,
                   keep_samples: bool = False, seed: tuple[int, int] | None = None,
                   scorer: SampleScorer | None = None) -> ValidationResult:
    """Answer, score and summarise every prompt of ``dataset`` (a ``PromptDataset``).

    ``generate``: the trainer's ``RolloutController.generate`` at the current weight version (or a
    ``RolloutClient.generate``: a test's one engine); ``reward``: RewardManager; ``rollout``: RolloutConfig (its
    ``val_kwargs``, ``max_response_length``, ``request_timeout_s``). Samples are ordered prompt-major,
    ``n`` answers per prompt in a row; the uid of an answer is its prompt's dataset row.
    ``keep_samples``: also return every sample's input, output, ground truth, score and scorer keys.
    ``seed``: (trainer.seed, step) of sampled answers' per-sample ``sampling_seed`` (mrl/driver/seeds.py).
    ``scorer``: the run's reward scorer (the trainer's; None = reward.function alone).
    """
    vk = rollout.val_kwargs
    params = val_sampling_params(vk, rollout.max_response_length)
    sources: list[str | None] = []
    uids: list[int] = []
    inputs: list[str] = []
    outputs: list[str] = []
    gts: list[Any] = []
    parts: list[RewardResult] = []
    owns: list[dict[str, torch.Tensor]] = []
    scorer = scorer or RuleScorer()
    for rows in prompt_chunks(len(dataset), val_batch_size):
        prompts = [dataset[i] for i in rows]
        seeds = group_seeds(seed[0], "val", seed[1], 0, list(rows), vk.n) if seed and vk.do_sample else None
        ids, image_data = request_inputs(prompts)  # pictures: the engine ids and SGLang's image_data
        res = generate(RolloutRequest(ids, n=vk.n, sampling_params=params, image_data=image_data,
                                      return_logprob=False, timeout_s=rollout.request_timeout_s,
                                      sampling_seeds=seeds, tools_kwargs=tools_kwargs_of(prompts)))
        if res.failed:
            raise RuntimeError(f"{len(res.failed)} of {len(res.samples)} validation samples failed, first: "
                               f"{res.failed[0].error}; see the engine logs (or raise rollout.request_timeout_s)")
        rep = with_agent_info(repeat_prompts(prompts, vk.n), res)  # sample i*n + j answers prompt i
        texts = decode_responses(tokenizer, res)

        def rule(extra: list, texts: list[str] = texts, rep: list = rep) -> RewardResult:
            return reward(texts, [p.ground_truth for p in rep], data_sources=[p.data_source for p in rep],
                          extra_infos=extra)

        def batch(rows: range = rows, res: RolloutResult = res) -> Any:  # only a scorer reading token ids asks
            return assemble_train_batch(dataset.collate(list(rows)), res, pad_token_id=dataset.pad_token_id,
                                        uids=list(rows))

        out, own = scorer.validate(Samples(rep, texts, batch), rule)
        owns.append(own)
        sources += [p.data_source for p in rep]
        uids += [r for r in rows for _ in range(vk.n)]
        outputs += texts
        parts.append(out)
        gts += [p.ground_truth for p in rep]
        if log_generations or keep_samples:
            inputs += [tokenizer.decode(p.prompt_ids, skip_special_tokens=True) for p in rep]
    scored = RewardResult.cat(parts) if parts else None
    scores: list[float] = scored.scores.tolist() if scored is not None else []
    infos = {"reward": scores, **(scored.extra if scored is not None else {})}  # verl: "reward" first
    if owns:  # the scorer's variables from its own per-sample values over every chunk (the RM's rm_score, ...)
        infos |= scorer.val_variables(infos, {k: torch.cat([o[k] for o in owns]) for k in owns[0]})
    metrics = validation_metric_dict(process_validation_metrics(sources, uids, infos))
    gens = pick_generations(inputs, outputs, scores, log_generations) if log_generations else []
    samples = GenerationRows(inputs, outputs, gts, scores, infos) if keep_samples else None
    return ValidationResult(metrics, gens, len(dataset), len(scores), samples)
