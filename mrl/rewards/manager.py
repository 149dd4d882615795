"""RewardManager: score a batch of responses and place each score on its last response token.

Seed 001 (verl ``NaiveRewardManager``): the sequence-level score s_i of sample i goes to the last
valid response token, all other positions 0::

    token_level_scores[i, t] = s_i  if t == last index with response_mask[i, t] == 1, else 0   # [B, T]

``on_error`` decides what a failing or timed-out call becomes: ``raise`` (RuntimeError naming the
sample), ``zero`` (score 0, still valid) or ``mask`` (score 0 and ``valid[i] = False``, so the
driver can drop the sample from the loss).
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import torch

from mrl.rewards.pool import Outcome, ScoringPool
from mrl.rewards.registry import ScoreFn, get_reward_fn

OnError = Literal["raise", "zero", "mask"]


@dataclass
class RewardResult:
    """Scores of one batch of B samples."""

    scores: torch.Tensor  # [B] float32, 0 where the call failed (zero/mask)
    valid: torch.Tensor  # [B] bool, False only for on_error=mask failures
    token_level_scores: torch.Tensor | None  # [B, T] float32, score on the last response token
    errors: list[str | None]  # per sample, None when scored


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
                    out.append((float(self.fn(**kw)), None))
            except Exception as e:  # noqa: BLE001 - any scorer failure is data for on_error
                out.append((None, f"{type(e).__name__}: {e}"))
        return out

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
        scores = torch.zeros(B, dtype=torch.float32)
        valid = torch.ones(B, dtype=torch.bool)
        errors: list[str | None] = []
        for i, (score, err) in enumerate(outcomes):
            errors.append(err)
            if err is None:
                scores[i] = score
                continue
            if self.on_error == "raise":
                raise RuntimeError(
                    f"reward function failed on sample {i} (response {responses[i][:80]!r}): {err}; "
                    "fix the scorer, or set reward.on_error=zero|mask to continue past failures"
                )
            if self.on_error == "mask":
                valid[i] = False
        tls = place_on_last_token(scores, response_mask) if response_mask is not None else None
        return RewardResult(scores=scores, valid=valid, token_level_scores=tls, errors=errors)

    def close(self) -> None:
        """Stop the worker processes (also done at exit: they are daemons)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
