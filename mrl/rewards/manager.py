"""RewardManager: score a batch of responses and place each score on its last response token.

As verl's ``NaiveRewardManager`` (docs/rewards.md): the sequence-level score s_i of sample i goes to the last
valid response token, all other positions 0::

    token_level_scores[i, t] = s_i  if t == last index with response_mask[i, t] == 1, else 0   # [B, T]

``on_error`` decides what a failing or timed-out call becomes: ``raise`` (RuntimeError naming the
sample), ``zero`` (score 0, still valid) or ``mask`` (score 0 and ``valid[i] = False``, so the
driver can drop the sample from the loss).

A scorer may return a dict (``mrl.rewards.outcome``): its ``score`` is the reward and all its keys
become ``RewardResult.extra`` (verl's ``reward_extra_info``). A return value outside that contract,
or key sets that differ between the samples of one call, always raise ``ScoreContractError`` (a
ValueError): they are bugs in the scorer, which ``on_error`` must not turn into zeros.
"""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self

import torch

from mrl.rewards.outcome import ExtraValue, Outcome, ScoreContractError, score_one
from mrl.rewards.pool import ScoringPool
from mrl.rewards.registry import ScoreFn, get_reward_fn

OnError = Literal["raise", "zero", "mask"]
log = logging.getLogger("mrl.rewards")


@dataclass
class RewardResult:
    """Scores of one batch of B samples.

    ``extra`` is verl's ``reward_extra_info``: {} when the scorer returns numbers; for a dict-returning
    scorer, each of its keys (``score`` included) -> B values in sample order: a float for numeric keys
    (bools become 1.0/0.0; units are the scorer's), ``str | None`` for ``pred``. A sample whose call
    failed under on_error=zero|mask has 0.0 in every numeric key (as its score) and ``pred`` None.
    """

    scores: torch.Tensor  # [B] float32, 0 where the call failed (zero/mask)
    valid: torch.Tensor  # [B] bool, False only for on_error=mask failures
    token_level_scores: torch.Tensor | None  # [B, T] float32, score on the last response token
    errors: list[str | None]  # per sample, None when scored
    extra: dict[str, list[ExtraValue]] = field(default_factory=dict)  # key -> [B]

    @property
    def num_errors(self) -> int:
        """Samples whose scoring failed (raised, timed out, bad value, worker died)."""
        return sum(e is not None for e in self.errors)

    @property
    def num_timeouts(self) -> int:
        return sum(e is not None and e.startswith("TimeoutError") for e in self.errors)

    def fault_metrics(self) -> dict[str, float]:
        """``reward/errors``, ``reward/timeouts`` and ``reward/zeroed_samples`` (failed and still in the
        loss with score 0: on_error=zero; masked samples leave the loss instead)."""
        zeroed = sum(e is not None and bool(v) for e, v in zip(self.errors, self.valid.tolist(), strict=True))
        return {"reward/errors": float(self.num_errors), "reward/timeouts": float(self.num_timeouts),
                "reward/zeroed_samples": float(zeroed)}

    @classmethod
    def cat(cls, parts: Sequence[RewardResult]) -> RewardResult:
        """Results of consecutive calls as one (``token_level_scores`` None: their T may differ).

        The extra keys must agree between parts, as within a call (verl's validation asserts one
        value per sample for every key); a part whose calls all failed has none and is filled.
        """
        keyed = [p for p in parts if p.extra]
        keys = list(keyed[0].extra) if keyed else []
        extra: dict[str, list[ExtraValue]] = {k: [] for k in keys}
        for p in parts:
            if not keys:
                break
            if p.extra.keys() == set(keys):
                for k in keys:
                    extra[k] += p.extra[k]
            elif not p.extra and all(e is not None for e in p.errors):  # every call failed: no keys seen
                for k in keys:
                    extra[k] += [_failed_value(k)] * len(p.errors)
            else:
                raise ScoreContractError(
                    f"reward extra keys differ between batches: {sorted(keys)} vs "
                    f"{sorted(p.extra) or '(a plain number)'}; fix: return the same dict keys for every sample")
        return cls(scores=torch.cat([p.scores for p in parts]), valid=torch.cat([p.valid for p in parts]),
                   token_level_scores=None, errors=[e for p in parts for e in p.errors], extra=extra)


def place_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] scores → [B, T] with scores[i] at the last t where response_mask[i, t] is set.

    Works for any mask layout (right padding, holes); a sample with an empty response gets no score.
    """
    if response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"response_mask must be [B, T] with B={scores.shape[0]}, got {tuple(response_mask.shape)}")
    mask = response_mask.bool()
    T = mask.shape[1]
    last = T - 1 - torch.flip(mask, dims=[1]).int().argmax(dim=1)  # [B]
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has = mask.any(dim=1)
    rows = torch.arange(mask.shape[0])[has]
    out[rows, last[has]] = scores.to(torch.float32)[has]
    return out


def _failed_value(key: str) -> ExtraValue:
    """Extra value of a sample whose call failed (on_error=zero|mask): 0.0 like its score; no ``pred``."""
    return None if key == "pred" else 0.0


class _Alarm:
    """SIGALRM timeout for in-process scoring; only possible on the main thread (else no limit)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.active = threading.current_thread() is threading.main_thread()

    def __enter__(self) -> None:
        if self.active:
            def _raise(signum: int, frame: Any) -> None:
                raise TimeoutError(f"scoring took more than timeout_s={self.seconds}s")

            self._old = signal.signal(signal.SIGALRM, _raise)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def __exit__(self, *exc: object) -> None:
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)


class RewardManager:
    """Scores (response, ground truth) pairs with ``function`` (see ``mrl.rewards.registry``).

    ``workers=0`` scores in this process (timeout via SIGALRM on the main thread only); ``workers>0``
    uses a ``ScoringPool`` whose stuck calls are killed after ``timeout_s``.
    """

    def __init__(self, function: str | ScoreFn = "gsm8k", *, workers: int = 0, timeout_s: float = 10.0,
                 on_error: OnError = "raise", mp_context: str = "spawn") -> None:
        if on_error not in ("raise", "zero", "mask"):
            raise ValueError(f"reward.on_error must be raise, zero or mask, got {on_error!r}")
        if timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {timeout_s}")
        self.fn = get_reward_fn(function)  # resolve now: a bad spec fails before any rollout
        self.name = function if isinstance(function, str) else \
            f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', repr(function))}"
        self.on_error, self.timeout_s = on_error, timeout_s
        # Workers get the spec string when there is one so they resolve it themselves (file scorers
        # are not importable by module name in a fresh process).
        self._pool = ScoringPool(function, workers, timeout_s, mp_context) if workers > 0 else None

    @classmethod
    def from_config(cls, cfg: Any) -> RewardManager:
        """From a ``mrl.config.reward.RewardConfig``."""
        return cls(cfg.function, workers=cfg.workers, timeout_s=cfg.timeout_s, on_error=cfg.on_error)

    def _score_in_process(self, calls: list[dict[str, Any]]) -> list[Outcome]:
        out: list[Outcome] = []
        for kw in calls:
            try:
                with _Alarm(self.timeout_s):
                    out.append(score_one(self.fn, kw))
            except TimeoutError as e:  # the alarm fired outside the scorer's own frames
                out.append(Outcome(None, None, error=f"TimeoutError: {e}"))
        return out

    def _where(self, i: int, call: dict[str, Any]) -> str:
        """``reward function 'x' on sample 3 (data_source='gsm8k', extra_info.index=17)``."""
        info = call.get("extra_info")
        row = f", extra_info.index={info['index']!r}" if isinstance(info, dict) and "index" in info else ""
        return f"reward function {self.name!r} on sample {i} (data_source={call.get('data_source')!r}{row})"

    def _extra(self, calls: list[dict[str, Any]], outcomes: list[Outcome]) -> dict[str, list[ExtraValue]]:
        """Per-key lists over the B samples; every scored sample must return the same keys."""
        scored = [i for i, o in enumerate(outcomes) if o.error is None]
        if not scored:
            return {}
        ref = scored[0]
        keys = list(outcomes[ref].extra)
        for i in scored[1:]:
            if set(outcomes[i].extra) != set(keys):
                raise ScoreContractError(
                    f"{self._where(i, calls[i])} returned keys {sorted(outcomes[i].extra) or '(a plain number)'} but "
                    f"sample {ref} returned {sorted(keys) or '(a plain number)'}; fix: return the same dict keys for "
                    "every sample (verl needs one value per sample for each key)"
                )
        return {k: [o.extra[k] if o.error is None else _failed_value(k) for o in outcomes] for k in keys}

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[Any],
                 response_mask: torch.Tensor | None = None, data_sources: Sequence[str | None] | None = None,
                 extra_infos: Sequence[dict | None] | None = None) -> RewardResult:
        """Score B responses; ``response_mask`` [B, T] (optional) yields ``token_level_scores`` [B, T]."""
        B = len(responses)
        if len(ground_truths) != B:
            raise ValueError(f"{B} responses but {len(ground_truths)} ground truths")
        calls = [
            {"solution_str": responses[i], "ground_truth": ground_truths[i],
             "data_source": data_sources[i] if data_sources is not None else None,
             "extra_info": extra_infos[i] if extra_infos is not None else None}
            for i in range(B)
        ]
        outcomes = self._pool.map(calls) if self._pool is not None else self._score_in_process(calls)
        for i, o in enumerate(outcomes):
            if o.broken is not None:  # a bug in the scorer, whatever reward.on_error says
                raise ScoreContractError(f"{self._where(i, calls[i])} {o.broken}")
        scores = torch.zeros(B, dtype=torch.float32)
        valid = torch.ones(B, dtype=torch.bool)
        errors: list[str | None] = []
        for i, o in enumerate(outcomes):
            errors.append(o.error)
            if o.error is None:
                scores[i] = o.score
                continue
            if self.on_error == "raise":
                raise RuntimeError(
                    f"{self._where(i, calls[i])} failed (response {responses[i][:80]!r}): {o.error}; "
                    "fix the scorer, or set reward.on_error=zero|mask to continue past failures"
                )
            if self.on_error == "mask":
                valid[i] = False
        failed = [i for i, e in enumerate(errors) if e is not None]
        if failed:  # never silent: count and the first error's text, under every policy
            i = failed[0]
            log.warning("%d of %d reward calls failed (reward.on_error=%s: %s); first: %s: %s", len(failed), B,
                        self.on_error, "score 0" if self.on_error == "zero" else "masked out of the loss",
                        self._where(i, calls[i]), errors[i][:300])
        extra = self._extra(calls, outcomes)
        tls = place_on_last_token(scores, response_mask) if response_mask is not None else None
        return RewardResult(scores=scores, valid=valid, token_level_scores=tls, errors=errors, extra=extra)

    def close(self) -> None:
        """Stop the worker processes (also done at exit: they are daemons)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
