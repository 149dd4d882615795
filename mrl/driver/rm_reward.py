"""The driver's side of phase ``rm_score`` (docs/reward_model.md), shared by training and validation.

* :func:`rm_input_batch` — verl's ``_switch_chat_template``: when the reward model has its own
  tokenizer or chat template (``reward_model.model.input_tokenizer``), each sample's response is
  decoded with the actor's tokenizer (EOS text removed), appended to the prompt's chat as the
  assistant turn, rendered with the RM's chat template (no generation prompt), tokenized by the RM's
  tokenizer without added special tokens, cut on the right at ``max_length`` (if set) and
  right-padded:

      input_ids [B, L]  t_0 ... t_{n_i-1} pad ... pad      (L = longest n_i <= max_length)

  The RM reads the last attended token of each row, as for the actor's own layout.
* :class:`RewardModelInputs` — the batch the ranks score: the actor's batch as it is (shared
  tokenizer) or the re-rendered one.
* :func:`combine_rm` — the sample rewards from the RM scores and ``reward.function`` per
  ``reward_model.combine`` (rm: the RM score; rule+rm: the sum; function: the function's score,
  which sees ``extra_info["rm_score"]`` whenever it is called).
* :func:`rm_rule_agreement` — where ``reward.function`` also reports a rule verdict (its ``acc`` key),
  how often the RM's verdict agrees with it: reward hacking made visible while it happens.
* :class:`RewardModelScorer` — the reward phase's scorer (mrl/driver/scoring.py) with a reward model, in
  training and validation: RM inputs, the RM's call, combine, its metrics and validation variables.

No Ray, no Megatron: the ranks' call is passed in.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mrl.data.dataset import Prompt
from mrl.data.tokenize import pad_token_id_of, position_ids_from_mask
from mrl.driver.scoring import Rule, Samples, SampleScorer
from mrl.observability.timer import timer
from mrl.rewards.manager import RewardResult
from mrl.workers.batch import TrainBatch


def chat_of(raw_prompt: str | Sequence[dict]) -> list[dict]:
    """The prompt as chat messages (a plain-text prompt is one user message)."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [dict(m) for m in raw_prompt]


def rm_texts(batch: TrainBatch, prompts: Sequence[Prompt], src_tokenizer: Any, rm_tokenizer: Any) -> list[str]:
    """Each sample's conversation rendered with the RM's chat template (verl's ``_switch_chat_template``)."""
    if len(prompts) != batch.batch_size:
        raise ValueError(f"{len(prompts)} prompts for a batch of {batch.batch_size} samples")
    R = batch.responses.shape[1]
    valid = batch.attention_mask[:, batch.input_ids.shape[1] - R:].bool()
    eos = getattr(src_tokenizer, "eos_token", None)
    out = []
    for i, p in enumerate(prompts):
        text = src_tokenizer.decode(batch.responses[i][valid[i]].tolist())
        if eos:
            text = text.replace(eos, "")
        chat = chat_of(p.raw_prompt) + [{"role": "assistant", "content": text}]
        out.append(rm_tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False))
    return out


def rm_input_batch(batch: TrainBatch, prompts: Sequence[Prompt], src_tokenizer: Any, rm_tokenizer: Any,
                   max_length: int | None = None) -> TrainBatch:
    """The re-rendered, right-padded RM batch (module doc); ``max_length`` None = not cut. (verl cuts at
    the actor batch's width by default, which loses the end of any conversation the RM's tokenizer
    spells in more tokens than the actor's — the very token the RM reads.)"""
    seqs = [list(rm_tokenizer(t, add_special_tokens=False)["input_ids"])[:max_length]
            for t in rm_texts(batch, prompts, src_tokenizer, rm_tokenizer)]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_token_id_of(rm_tokenizer), dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    # No response columns: the RM reads one whole sequence (its last attended token).
    return TrainBatch(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                      responses=ids[:, :0], response_mask=mask[:, :0])


@dataclass
class RewardModelInputs:
    """What the ranks' RM scores: ``rm_tokenizer`` None = the actor's batch as it is."""

    src_tokenizer: Any
    rm_tokenizer: Any = None
    max_length: int | None = None

    @classmethod
    def from_config(cls, cfg: Any, src_tokenizer: Any) -> RewardModelInputs:
        rm = cfg.reward_model
        if rm.model.input_tokenizer is None:
            return cls(src_tokenizer)
        from transformers import AutoTokenizer

        return cls(src_tokenizer, AutoTokenizer.from_pretrained(rm.model.path), rm.max_length)

    def __call__(self, batch: TrainBatch, prompts: Sequence[Prompt]) -> TrainBatch:
        if self.rm_tokenizer is None:
            return batch
        return rm_input_batch(batch, prompts, self.src_tokenizer, self.rm_tokenizer, self.max_length)


def combine_rm(combine: str, rm_scores: torch.Tensor, rule: Callable[[list[dict | None]], RewardResult],
               extra_infos: Sequence[dict | None]) -> RewardResult:
    """The samples' rewards per ``reward_model.combine`` (module doc). ``rule(extra_infos)`` calls
    ``reward.function``; it is not called for combine=rm (verl: the reward manager returns rm_scores)."""
    if combine == "rm":
        B = rm_scores.shape[0]
        return RewardResult(rm_scores, torch.ones(B, dtype=torch.bool), None, [None] * B, {})
    extra = [{**(e or {}), "rm_score": float(s)} for e, s in zip(extra_infos, rm_scores, strict=True)]
    out = rule(extra)
    if combine == "rule+rm":  # the rule's token_level_scores no longer hold the reward: dropped
        out = dataclasses.replace(out, scores=out.scores + rm_scores, token_level_scores=None)
    return out


def rm_rule_agreement(rm_scores: torch.Tensor, acc: Sequence[Any]) -> dict[str, list[float]]:
    """Per sample, the RM against the rule (reward hacking shows as the RM paying for rule-wrong answers)::

        rm_ok_i       = rm_score_i > 0          (σ(rm_score_i) > 0.5: the RM's "right")
        rule_ok_i     = acc_i >= 0.5            (the rule's verdict, reward.function's ``acc`` key)
        agree_i       = [rm_ok_i == rule_ok_i]
        fooled_i      = [rm_ok_i and not rule_ok_i]
        wrong_prob_i  = σ(rm_score_i) · [not rule_ok_i]

    ``wrong_prob`` catches what the verdicts miss: a policy that moves to answers the RM is unsure
    of (σ 0.4 where wrong sums get 0.01) gains reward with every verdict still "wrong".
    A sample whose ``acc`` is missing (None: its scoring failed) counts as the rule's "wrong".
    Returns {"agree", "fooled", "wrong_prob"} -> [B] floats."""
    if rm_scores.shape[0] != len(acc):
        raise ValueError(f"{rm_scores.shape[0]} RM scores for {len(acc)} rule verdicts")
    prob = torch.sigmoid(rm_scores.float()).tolist()
    rule_ok = [a is not None and float(a) >= 0.5 for a in acc]
    return {"agree": [float((p > 0.5) == u) for p, u in zip(prob, rule_ok, strict=True)],
            "fooled": [float(p > 0.5 and not u) for p, u in zip(prob, rule_ok, strict=True)],
            "wrong_prob": [0.0 if u else p for p, u in zip(prob, rule_ok, strict=True)]}


def rm_rule_metrics(rm_scores: torch.Tensor, extra: dict[str, list[Any]] | None) -> dict[str, float]:
    """Training metrics of :func:`rm_rule_agreement`, {} when ``reward.function`` reports no ``acc``:
    ``reward/rm_rule_agreement`` (fraction of samples whose RM verdict agrees with the rule's),
    ``reward/rm_fooled`` (fraction the RM accepts and the rule rejects) and ``reward/rm_prob_wrong``
    (mean σ(rm_score) over the rule-wrong samples, 0 when there are none: what a wrong answer earns)."""
    if not extra or "acc" not in extra or rm_scores.shape[0] == 0:
        return {}
    per = rm_rule_agreement(rm_scores, extra["acc"])
    B = len(per["agree"])
    n_wrong = sum(a is None or float(a) < 0.5 for a in extra["acc"])
    return {"reward/rm_rule_agreement": sum(per["agree"]) / B, "reward/rm_fooled": sum(per["fooled"]) / B,
            "reward/rm_prob_wrong": sum(per["wrong_prob"]) / n_wrong if n_wrong else 0.0}


class RewardModelScorer(SampleScorer):
    """``reward_model.enable``: the RM's [B] scores (``rm``: the side model's call, on the trainer ranks or its own
    group; ``inputs``: its input batch) combined with ``reward.function`` per ``combine`` (reward_model.combine)."""

    def __init__(self, rm: Callable[[TrainBatch], torch.Tensor], inputs: RewardModelInputs, combine: str) -> None:
        self.rm, self.inputs, self.combine = rm, inputs, combine

    def rm_scores(self, samples: Samples) -> torch.Tensor:
        return self.rm(self.inputs(samples.batch, samples.prompts)).float()

    def train(self, samples: Samples, rule: Rule, metrics: dict[str, float]) -> RewardResult:
        with timer("rm_score", metrics):  # verl: rm_scores reach the reward manager, which returns them (combine=rm)
            rm_scores = self.rm_scores(samples)
        for stat in ("mean", "max", "min"):
            metrics[f"critic/rm_score/{stat}"] = float(getattr(rm_scores, stat)())
        out = combine_rm(self.combine, rm_scores, rule, samples.extra_infos)
        if self.combine != "rm":  # reward.function was called
            metrics.update(out.fault_metrics())  # reward/errors, reward/timeouts, reward/zeroed_samples
            # the RM's verdict vs the rule's acc, if the function reports one: hacking shows here
            metrics.update(rm_rule_metrics(rm_scores, out.extra))
        return out

    def validate(self, samples: Samples, rule: Rule) -> tuple[RewardResult, dict[str, torch.Tensor]]:
        rm_scores = self.rm_scores(samples)
        return combine_rm(self.combine, rm_scores, rule, samples.extra_infos), {"rm_score": rm_scores}

    def val_variables(self, infos: dict[str, list[Any]], own: dict[str, torch.Tensor]) -> dict[str, list[Any]]:
        """``rm_score`` (unless reward.function reports a key of that name) and, when the function reports
        ``acc``, ``rm_rule_agree``, ``rm_fooled`` and ``rm_wrong_prob`` (:func:`rm_rule_agreement`)."""
        rm_scores = own["rm_score"]
        out: dict[str, list[Any]] = {}
        if "rm_score" not in infos:
            out["rm_score"] = [float(v) for v in rm_scores]
        if "acc" in infos:
            per = rm_rule_agreement(rm_scores, infos["acc"])
            out["rm_rule_agree"], out["rm_fooled"], out["rm_wrong_prob"] = per["agree"], per["fooled"], per["wrong_prob"]
        return out
