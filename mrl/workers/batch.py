"""The typed batch record the train workers consume (design rule 3: one vocabulary, with units).

Units used throughout ``mrl.workers``:

* **prompts**: rows of the dataset. ``ppo_mini_batch_size`` in the config counts prompts.
* **samples**: prompt × response pairs; one row of :class:`TrainBatch`. A step holds
  ``train_batch_size × rollout.n`` samples; a mini-batch ``ppo_mini_batch_size × n`` samples
  (``mini_batch_size_samples``, global over DP ranks).
* **tokens**: valid positions; ``attention_mask.sum()`` counts prompt+response tokens,
  ``response_mask.sum()`` the tokens the loss sees.
* **global** = summed over all DP ranks; **local** = this rank's share.

Layout (verl's): ``input_ids = [prompt (left-padded to P) | response (right-padded
to R)]`` so S = P + R; ``responses = input_ids[:, P:]``. Per-token tensors that belong to the
response (log-probs, advantages, …) are ``[B, R]`` and aligned with ``responses``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

Tensor = torch.Tensor

#: Always kept by :meth:`TrainBatch.select`: the model input and the loss mask.
REQUIRED_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
#: Kept by :meth:`TrainBatch.select` whenever present: the engine's expert choice replayed in every forward.
ROUTING_KEYS = ("routed_experts",)
#: Kept by :meth:`TrainBatch.select` whenever present: the pictures every forward of a vision-language model reads.
MULTI_MODAL_KEYS = ("multi_modal",)
#: Optional per-token response fields, each [B, R].
RESPONSE_KEYS = (
    "old_log_probs", "advantages", "ref_log_prob", "rollout_log_probs", "values", "returns", "rollout_is_weights",
    "teacher_log_prob",
)


@dataclass
class TrainBatch:
    """A batch of samples, all tensors on the same device, first dim B (samples).

    Attributes:
        input_ids: [B, S] int64, prompt left-padded to P then response right-padded to R.
        attention_mask: [B, S] {0,1}; 1 on valid prompt and response tokens.
        position_ids: [B, S] int64; position of each token within its own sequence (0 at the
            first valid prompt token).
        responses: [B, R] int64, ``input_ids[:, P:]``.
        response_mask: [B, R] {0,1}; 1 on response tokens that enter the loss (a subset of
            ``attention_mask[:, P:]``; multi-turn tool output may be 0 here).
        old_log_probs: [B, R] log π_old(a_t|s_t) from ``compute_log_prob`` (the PPO ratio's
            denominator).
        advantages: [B, R] A_t.
        ref_log_prob: [B, R] log π_ref(a_t|s_t); needed iff ``use_kl_loss``.
        teacher_log_prob: [B, R] log π_teacher(a_t|s_t) of the student's sampled tokens (on-policy
            distillation, ``algorithm.distill``); read by the loss iff ``distill.mode=kl_loss``.
        rollout_log_probs: [B, R] log-probs reported by the inference engine; needed iff
            truncated importance sampling (``tis_imp_ratio_cap > 0``) is on.
        values: [B, R] V_old(s_t) from the critic (PPO).
        rollout_is_weights: [B, R] detached rollout-correction weights (``algorithm.rollout_correction.rollout_is``),
            multiplying the policy loss; 0 on padding.
        returns: [B, R] value targets (PPO).
        uid: [B] int64 group id (samples of one prompt share it); travels with the sample.
        routed_experts: [B, S, L_moe, K] int, the top-k experts the inference engine chose for every
            token of ``input_ids`` in each MoE layer (``actor.moe.routing_replay=rollout``); positions the
            engine never ran (padding, the last response token) hold any valid id: no kept output depends
            on them.
        multi_modal: one dict per sample (vision-language models): ``{"pixel_values": [n_patches, D] float,
            "image_grid_thw": [n_images, 3] int64}`` as the checkpoint's image processor returns them for the sample's
            pictures in order, ``{}`` for a sample without pictures; ``input_ids`` hold every image token already
            (one per merged patch), ``position_ids`` stay the text positions (the model derives its 3-D ones).
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    responses: Tensor
    response_mask: Tensor
    old_log_probs: Tensor | None = None
    advantages: Tensor | None = None
    ref_log_prob: Tensor | None = None
    rollout_log_probs: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    rollout_is_weights: Tensor | None = None
    teacher_log_prob: Tensor | None = None
    uid: Tensor | None = None
    routed_experts: Tensor | None = None
    multi_modal: list[dict[str, Tensor]] | None = None

    def __post_init__(self) -> None:
        B, S = self.input_ids.shape
        R = self.responses.shape[1]
        if R > S:
            raise ValueError(f"TrainBatch: responses has {R} columns but input_ids only {S}")
        for name in ("attention_mask", "position_ids"):
            t = getattr(self, name)
            if tuple(t.shape) != (B, S):
                raise ValueError(
                    f"TrainBatch.{name} has shape {tuple(t.shape)}, expected [B, S] = {(B, S)} "
                    "like input_ids"
                )
        for name in ("responses", "response_mask") + RESPONSE_KEYS:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B, R):
                raise ValueError(
                    f"TrainBatch.{name} has shape {tuple(t.shape)}, expected [B, R] = {(B, R)} "
                    "aligned with responses"
                )
        re = self.routed_experts
        if re is not None and (re.dim() != 4 or tuple(re.shape[:2]) != (B, S)):
            raise ValueError(f"TrainBatch.routed_experts has shape {tuple(re.shape)}, expected [B, S, layers, top_k] "
                             f"with [B, S] = {(B, S)} like input_ids")
        if self.multi_modal is not None and len(self.multi_modal) != B:
            raise ValueError(f"TrainBatch.multi_modal has {len(self.multi_modal)} entries, expected one per sample ({B})")
        if self.uid is not None and tuple(self.uid.shape) != (B,):
            raise ValueError(f"TrainBatch.uid has shape {tuple(self.uid.shape)}, expected [{B}]")

    # ---- sizes -------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """B, in samples."""
        return int(self.input_ids.shape[0])

    @property
    def prompt_length(self) -> int:
        """P, the padded prompt width."""
        return int(self.input_ids.shape[1] - self.responses.shape[1])

    @property
    def response_length(self) -> int:
        """R, the padded response width."""
        return int(self.responses.shape[1])

    def seq_lengths(self) -> Tensor:
        """[B] valid (prompt + response) tokens per sample."""
        return self.attention_mask.sum(-1).long()

    def keys(self) -> list[str]:
        """Names of the fields that are present (not None)."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    # ---- structural ops ----------------------------------------------------------------
    def _map(self, fn, rows) -> TrainBatch:
        """``fn`` on every tensor field, ``rows`` on the per-sample list (``multi_modal``)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = None if v is None else rows(v) if isinstance(v, list) else fn(v)
        return TrainBatch(**out)

    def index(self, idx: Tensor | list[int]) -> TrainBatch:
        """Rows ``idx`` (any order, e.g. a permutation) of every field."""
        idx_t = torch.as_tensor(idx, dtype=torch.long, device=self.input_ids.device)
        pick = idx_t.tolist()
        return self._map(lambda t: t.index_select(0, idx_t.to(t.device)), lambda rows: [rows[i] for i in pick])

    def slice(self, start: int, end: int) -> TrainBatch:
        """Rows ``start:end``."""
        return self._map(lambda t: t[start:end], lambda rows: rows[start:end])

    def to(self, device: torch.device | str) -> TrainBatch:
        return self._map(lambda t: t.to(device), lambda rows: [{k: v.to(device) for k, v in d.items()} for d in rows])

    def select(self, keys: Iterable[str]) -> TrainBatch:
        """Keep :data:`REQUIRED_KEYS` plus ``keys``; every requested key must be present.

        Raises:
            KeyError naming the missing key and the phase that produces it.
        """
        keys = list(keys)
        missing = [k for k in keys if getattr(self, k, None) is None]
        if missing:
            raise KeyError(
                f"TrainBatch lacks {missing} needed by the loss; produce them first "
                "(old_log_probs: actor.compute_log_prob, ref_log_prob: compute_ref_log_prob, teacher_log_prob: "
                "the teacher's compute_side, "
                "advantages: the advantage estimator, rollout_log_probs: the rollout engine, "
                "values/returns: critic.compute_values + GAE)"
            )
        keep = set(REQUIRED_KEYS) | set(ROUTING_KEYS) | set(MULTI_MODAL_KEYS) | set(keys)
        return TrainBatch(**{
            f.name: getattr(self, f.name) if f.name in keep else None for f in fields(self)
        })

    def replace(self, **changes) -> TrainBatch:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def concat(batches: list[TrainBatch]) -> TrainBatch:
        """Concatenate along B; all batches must have the same fields and widths."""
        first = batches[0]
        out = {}
        for f in fields(first):
            vals = [getattr(b, f.name) for b in batches]
            if all(v is None for v in vals):
                out[f.name] = None
            elif any(v is None for v in vals):
                raise ValueError(f"TrainBatch.concat: field {f.name} present in only some batches")
            elif isinstance(vals[0], list):
                out[f.name] = [row for v in vals for row in v]
            else:
                out[f.name] = torch.cat(vals, 0)
        return TrainBatch(**out)
