"""Mini-batch iteration, micro-batching and the packed model inputs of one micro-batch.

Hierarchy of one training step (units as in :mod:`mrl.workers.batch`)::

    step batch (B samples, every rank holds all of it, DP-balanced by the driver)
      └─ DP shard r: samples [r*B/D, (r+1)*B/D)                       (contiguous, verl dispatch)
          └─ mini-batch k: local samples [k*b, (k+1)*b), b = mini_batch_size_samples / D
              └─ micro-batches: fixed (micro_batch_size samples, sorted by length) or dynamic
                 (token budget, balanced partition, same count on every DP rank)

``make_minibatch_iterator`` follows verl's Megatron actor (verl's ``megatron_actor.py``
``make_minibatch_iterator``): it selects only the keys the loss needs — ``ref_log_prob`` iff
``use_kl_loss``, ``rollout_log_probs`` iff TIS (``tis_imp_ratio_cap``) is on, ``rollout_is_weights`` iff the
trainer's rollout correction computed them.

Model inputs are the *compact* BSHD layout: each sample's valid tokens (prompt then response,
padding removed) start at column 0 and are right-padded, so the causal mask alone is correct and
no padding token is attended; it runs on every attention backend. With ``actor.use_remove_padding`` a
micro-batch is instead one *packed* row of whole sequences (:func:`build_packed_inputs`: no right padding,
sequence boundaries applied by mrl's SDPA attention), and with ``actor.shared_prefix`` one row per prompt
(:func:`build_shared_prefix_inputs`).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mrl.data.balance import get_seqlen_balanced_partitions
from mrl.workers.batch import TrainBatch

Tensor = torch.Tensor


def loss_keys(*, use_kl_loss: bool, use_rollout_log_probs: bool, use_rollout_is_weights: bool = False,
              use_teacher_kl: bool = False) -> list[str]:
    """Optional TrainBatch fields the actor loss reads (verl ``select_keys``); ``use_teacher_kl``: the
    distillation loss term (``algorithm.distill.mode=kl_loss``) reads ``teacher_log_prob``."""
    keys = ["old_log_probs", "advantages"]
    if use_teacher_kl:
        keys.append("teacher_log_prob")
    if use_rollout_is_weights:
        keys.append("rollout_is_weights")
    if use_kl_loss:
        keys.append("ref_log_prob")
    if use_rollout_log_probs:
        keys.append("rollout_log_probs")
    return keys


def make_minibatch_iterator(
    batch: TrainBatch,
    *,
    mini_batch_size: int,
    epochs: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    select_keys: list[str] | None = None,
) -> Iterator[TrainBatch]:
    """Yield ``epochs × (B_local / mini_batch_size)`` mini-batches of this rank's shard.

    Args:
        batch: this DP rank's samples (B_local).
        mini_batch_size: local samples per mini-batch (``mini_batch_size_samples / DP``).
        epochs: passes over the shard (``ppo_epochs``).
        shuffle: permute samples each epoch with ``torch.Generator().manual_seed(seed + epoch)``
            (deterministic, so a resumed run replays the same order).
        select_keys: optional fields to keep (see :func:`loss_keys`); ``None`` keeps all.
    """
    n = batch.batch_size
    if mini_batch_size < 1 or n % mini_batch_size != 0:
        raise ValueError(
            f"local batch of {n} samples is not divisible by the local mini-batch size "
            f"{mini_batch_size}; make train_batch_size*rollout.n a multiple of "
            "ppo_mini_batch_size*rollout.n, and that a multiple of the DP size"
        )
    if select_keys is not None:
        batch = batch.select(select_keys)
    for epoch in range(epochs):
        if shuffle:
            g = torch.Generator().manual_seed(seed + epoch)
            data = batch.index(torch.randperm(n, generator=g))
        else:
            data = batch
        for start in range(0, n, mini_batch_size):
            yield data.slice(start, start + mini_batch_size)


def split_fixed(n: int, micro_batch_size: int) -> list[list[int]]:
    """Contiguous micro-batches of ``micro_batch_size`` samples (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [list(range(s, min(s + micro_batch_size, n))) for s in range(0, n, micro_batch_size)]


def split_by_length(seq_lengths: list[int], micro_batch_size: int) -> list[list[int]]:
    """Micro-batches of ``micro_batch_size`` samples of similar length: samples sorted by token count
    (stable), then cut. A micro-batch is padded to its longest sample (BSHD), so grouping similar
    lengths removes most of that padding; the loss and gradients do not depend on which samples
    share a micro-batch (global denominators; tests/workers/test_layout_invariance.py)."""
    order = sorted(range(len(seq_lengths)), key=seq_lengths.__getitem__)
    return [[order[i] for i in p] for p in split_fixed(len(order), micro_batch_size)]


def at_least(parts: list[list[int]], k: int) -> list[list[int]]:
    """``parts`` with the largest one halved until there are ``k`` (or every part holds one sample): Megatron's
    interleaved pipeline schedule (virtual pipeline stages) runs at least PP micro-batches per call. Smaller
    micro-batches change no value (global denominators); the memory bound of the split only gets looser."""
    out = [list(p) for p in parts]
    while len(out) < k:
        i = max(range(len(out)), key=lambda j: len(out[j]))
        if len(out[i]) < 2:
            break
        half = len(out[i]) // 2
        out[i:i + 1] = [out[i][:half], out[i][half:]]
    return out


def split_dynamic(
    seq_lengths: list[int], max_tokens: int, *, dp_group=None, min_parts: int = 1
) -> list[list[int]]:
    """Token-budget micro-batches, the same number on every rank of ``dp_group``.

    k = max over DP ranks of ceil(Σ tokens / max_tokens) (verl ``rearrange_micro_batches``): the
    pipeline schedule runs the same number of micro-batches everywhere. Samples are then split
    into k balanced partitions (:func:`get_seqlen_balanced_partitions`); a partition may exceed
    the budget slightly when balance forces it, never by more than one sample. ``min_parts``: at least that
    many (the same on every rank: the DP ranks hold equal sample counts).
    """
    longest = max(seq_lengths)
    if longest > max_tokens:
        raise ValueError(
            f"a sample has {longest} tokens but the micro-batch token budget is {max_tokens}; "
            "raise ppo_max_token_len_per_gpu to at least max_prompt_length + max_response_length"
        )
    k = math.ceil(sum(seq_lengths) / max_tokens)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        t = torch.tensor([k], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
        k = int(t.item())
    k = min(max(k, min_parts), len(seq_lengths))
    return get_seqlen_balanced_partitions(seq_lengths, k, equal_size=False)


def restore_order(chunks: list[Tensor], parts: list[list[int]]) -> Tensor:
    """Inverse of a micro-batch split: rows of ``chunks[i]`` belong to ``parts[i]``."""
    idx = torch.tensor([i for p in parts for i in p], dtype=torch.long)
    cat = torch.cat(chunks, 0)
    out = torch.empty_like(cat)
    out[idx.to(cat.device)] = cat
    return out


@dataclass
class ModelInputs:
    """Compact right-padded inputs of one micro-batch (b samples, L columns).

    Attributes:
        tokens: [b, L] int64 valid tokens from column 0, then pad (0).
        position_ids: [b, L] int64, the batch's position ids of those tokens (pad: 0).
        labels: [b, L] int64 next token, ``labels[:, t] = tokens[:, t+1]`` (last column 0).
        resp_index: [b, R] int64 column whose logits predict response token j (0 if invalid).
        resp_valid: [b, R] bool, response token j exists (``attention_mask[:, P:]``).
        num_tokens: [b] valid tokens per sample (shared-prefix rows: [rows], valid tokens per row).
    """

    tokens: Tensor
    position_ids: Tensor
    labels: Tensor
    resp_index: Tensor
    resp_valid: Tensor
    num_tokens: Tensor
    # Shared-prefix layout only (:func:`build_shared_prefix_inputs`); None in the compact layout.
    attention_mask: Tensor | None = None  # [rows, 1, L, L] bool, True = not attended (Megatron's convention)
    resp_row: Tensor | None = None  # [b] int64, the row holding sample i
    # The column of row resp_row[i] whose logits predict sample i's first response token (the prompt's
    # last token, shared by the group: one column, n labels), that token (0 if none), and where it is.
    first_col: Tensor | None = None  # [b] int64
    first_label: Tensor | None = None  # [b] int64
    resp_first: Tensor | None = None  # [b, R] bool
    # Routing replay: [rows, L, layers, K] engine expert ids of each column (-1: none).
    routed_experts: Tensor | None = None
    # Packed layout only (:func:`build_packed_inputs`): [k + 1] int64 sequence boundaries of the one row (the last
    # sequence may be padding); attention and RoPE restart at each.
    cu_seqlens: Tensor | None = None
    # Context parallelism only (:func:`shard_for_cp`): the global column of each local column of this CP rank's
    # zigzag share of the packed row, the permutation that puts the CP ranks' gathered rows back in global order,
    # the CP process group and the whole row's length. ``cu_seqlens`` stays the whole row's.
    cp_cols: Tensor | None = None
    cp_order: Tensor | None = None
    cp_group: Any = None
    cp_full_len: int | None = None

    def full_length(self) -> int:
        """Columns of the whole row (this CP rank's share is ``tokens.shape[1]``)."""
        return self.cp_full_len if self.cp_full_len is not None else int(self.tokens.shape[1])

    def _packed_valid(self) -> Tensor:
        """[L] bool over the whole packed row: column holds a sample's token (sequence i's first n_i columns)."""
        cu = self.cu_seqlens
        starts = cu[:-1][: len(self.num_tokens)]  # type: ignore[index]
        cols = torch.arange(int(cu[-1]))  # type: ignore[index]
        seq = torch.searchsorted(cu, cols, right=True) - 1  # type: ignore[arg-type]
        n = torch.cat([self.num_tokens, torch.zeros(len(cu) - 1 - len(starts), dtype=self.num_tokens.dtype)])  # type: ignore[arg-type]
        return cols - cu[seq] < n[seq]  # type: ignore[index]

    def padding(self) -> int:
        """Positions of ``tokens`` that hold no token of any sample (right padding, alignment padding; with CP the
        padding columns of this rank's share)."""
        if self.cu_seqlens is not None:
            return int(self.padding_mask().sum())
        return int(self.tokens.numel() - self.num_tokens.sum())

    def padding_mask(self) -> Tensor:
        """[rows, L] bool, True where a column holds no sample's token (Megatron's ``padding_mask``: MoE routers
        leave those positions out of the load-balancing and z losses and of the expert-bias token counts).
        Every layout holds its tokens from column 0: compact rows past each sample's ``num_tokens``, shared-prefix
        rows past each row's (``num_tokens`` is per row there: the prompt, then the samples' segments), the
        packed row past all samples' tokens (alignment padding)."""
        if self.cu_seqlens is not None:  # sequences padded at their ends (CP), the row at its end (alignment)
            valid = self._packed_valid()
            return ~(valid if self.cp_cols is None else valid[self.cp_cols]).unsqueeze(0)
        cols = torch.arange(self.tokens.shape[1]).unsqueeze(0)
        return cols >= self.num_tokens.unsqueeze(1)

    def first_token_logits(self, logits: Tensor) -> Tensor:
        """[rows, L, V] → [b, V]: the logits that predict each sample's first response token."""
        dev = logits.device
        return logits[self.resp_row.to(dev), self.first_col.to(dev)]  # type: ignore[union-attr]

    def gather_response(self, per_pos: Tensor, first: Tensor | None = None) -> Tensor:
        """[rows, L] per-position values (e.g. log-probs of ``labels``) → [b, R], 0 where invalid.
        Shared-prefix inputs also need ``first`` [b]: the values of each sample's first response token,
        computed from :meth:`first_token_logits` (its column predicts n tokens, one per sample)."""
        # The inputs are built on the host; the model's outputs live on its device (CUDA: found by the first
        # run on a GPU — the CPU suite cannot see a device mismatch).
        if self.cp_cols is not None:  # this CP rank's share -> the whole row, the same on every CP rank
            from mrl.megatron.context_parallel import gather_same_loss

            every = gather_same_loss(per_pos, self.cp_group)  # [cp, 1, L/cp]
            per_pos = every[:, 0].reshape(-1)[self.cp_order.to(per_pos.device)][None]  # type: ignore[union-attr]
        if self.resp_row is not None:
            per_pos = per_pos.index_select(0, self.resp_row.to(per_pos.device))
        out = per_pos.gather(1, self.resp_index.to(per_pos.device))
        if self.resp_first is not None:
            if first is None:
                raise ValueError("shared-prefix inputs: pass the first response token's values (first_token_logits)")
            out = torch.where(self.resp_first.to(out.device), first.to(out.dtype)[:, None], out)
        return out * self.resp_valid.to(out.device, out.dtype)


def build_model_inputs(mb: TrainBatch, *, pad_to_multiple: int = 1) -> ModelInputs:
    """Remove padding and left-align each sample (see module docstring).

    Logits at compact column t predict token t+1, so response token j of sample i (compact
    column c_ij = p_i + #valid response tokens before j) is scored by the logits at c_ij − 1.

    Raises:
        ValueError when a sample has an empty prompt (nothing to condition its first response
        token on).
    """
    am = mb.attention_mask.bool()
    b, s = am.shape
    P = mb.prompt_length
    n_tok = am.sum(-1)
    prompt_len = am[:, :P].sum(-1)
    if bool((prompt_len == 0).any()):
        bad = torch.nonzero(prompt_len == 0).flatten().tolist()
        raise ValueError(f"samples {bad} have an empty prompt (attention_mask[:, :P] all 0)")
    cols = torch.arange(s, device=am.device)
    # Stable sort key: valid positions first in original order, then padding.
    order = torch.argsort((~am).long() * s + cols, dim=1)
    L = int(n_tok.max())
    L = ((L + pad_to_multiple - 1) // pad_to_multiple) * pad_to_multiple
    order = order[:, :L] if L <= s else torch.cat([order, order[:, -1:].expand(b, L - s)], 1)
    keep = torch.arange(L, device=am.device)[None, :] < n_tok[:, None]
    tokens = torch.where(keep, mb.input_ids.gather(1, order), 0)
    pos = torch.where(keep, mb.position_ids.gather(1, order), 0)
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    resp_valid = am[:, P:]
    comp_col = prompt_len[:, None] + resp_valid.long().cumsum(-1) - 1
    resp_index = torch.where(resp_valid, comp_col - 1, 0)
    routed = None
    if mb.routed_experts is not None:
        re = mb.routed_experts
        idx = order[:, :, None, None].expand(b, L, *re.shape[2:]).to(re.device)
        routed = torch.where(keep[:, :, None, None], re.gather(1, idx), -1)  # -1: no engine id (padding)
    return ModelInputs(tokens, pos, labels, resp_index, resp_valid, n_tok, routed_experts=routed)


def build_packed_inputs(mb: TrainBatch, *, pad_to_multiple: int = 1, seq_multiple: int = 1) -> ModelInputs:
    """One row of whole sequences, no padding between them (verl's ``use_remove_padding``)::

        [s^1_0 … s^1_{n1-1} | s^2_0 … s^2_{n2-1} | … | pad to a multiple of pad_to_multiple]

    Sample i's valid tokens (prompt then response, as in :func:`build_model_inputs`) start at column
    ``o_i = n_1 + … + n_{i-1}`` at positions ``0 … n_i − 1``; ``cu_seqlens = [0, o_2, …, Σ n, (L)]`` bounds the
    sequences for the attention (none attends across a boundary). Column ``o_i + t`` then sees exactly what
    compact column ``t`` of sample i sees, so log-probs, values and gradients equal the compact layout's up to
    the float order of the kernels. Labels are the next token within the sample (a sample's last column
    predicts nothing: label 0, never read); ``resp_row`` is 0 for every sample and ``resp_index`` the packed
    column. Positions computed: Σ n_i (+ alignment) instead of b · max n_i.

    ``seq_multiple`` (context parallelism: ``2·CP``, ``·TP`` with sequence parallelism) pads each sequence at its
    end to a multiple of it (token 0, label 0, positions continuing): ``n_i`` becomes ``N_i = ⌈n_i / m⌉·m`` in the
    offsets and ``cu_seqlens``; causal attention keeps every real token blind to its sequence's padding.
    """
    c = build_model_inputs(mb)  # compact rows: [b, Lc], valid tokens from column 0
    b, Lc = c.tokens.shape
    n = c.num_tokens
    keep = torch.arange(Lc)[None, :] < n[:, None]
    padded = (n + seq_multiple - 1) // seq_multiple * seq_multiple  # [b] columns of each sequence
    offset = torch.cumsum(padded, 0) - padded  # [b] first column of each sample
    T = int(padded.sum())
    L = ((T + pad_to_multiple - 1) // pad_to_multiple) * pad_to_multiple
    tokens = torch.zeros(1, L, dtype=torch.long)
    labels = torch.zeros(1, L, dtype=torch.long)
    where = (offset[:, None] + torch.arange(Lc)[None, :])[keep]  # packed column of each valid token
    seq = torch.repeat_interleave(torch.arange(b), padded)
    pos = torch.zeros(1, L, dtype=torch.long)
    pos[0, :T] = torch.arange(T) - offset[seq]  # 0 .. N_i - 1 within each sequence (padding: continuing)
    tokens[0, where] = c.tokens[keep]
    # the compact label of column t is token t + 1 of the same row: the sample's last column gets 0 there
    labels[0, where] = torch.where(torch.arange(Lc)[None, :] < (n - 1)[:, None], c.labels, 0)[keep]
    resp_index = torch.where(c.resp_valid, c.resp_index + offset[:, None], 0)
    bounds = [0, *torch.cumsum(padded, 0).tolist()] + ([L] if L > T else [])
    routed = None
    if c.routed_experts is not None:
        re = c.routed_experts
        routed = torch.full((1, L, *re.shape[2:]), -1, dtype=re.dtype)
        routed[0, where] = re[keep]
    return ModelInputs(tokens, pos, labels, resp_index, c.resp_valid, n, routed_experts=routed,
                       resp_row=torch.zeros(b, dtype=torch.long), cu_seqlens=torch.tensor(bounds, dtype=torch.long))


def shard_for_cp(inp: ModelInputs, group: Any) -> ModelInputs:
    """This CP rank's zigzag share of a packed row (:mod:`mrl.megatron.context_parallel`): chunks ``r`` and
    ``2·CP − 1 − r`` of every sequence of ``cu_seqlens`` (each a multiple of ``2·CP`` long, see
    :func:`build_packed_inputs`'s ``seq_multiple``), with their global positions and labels. Response indices
    and ``cu_seqlens`` keep referring to the whole row (:meth:`ModelInputs.gather_response` gathers it back)."""
    from mrl.megatron.context_parallel import global_order, local_columns

    if inp.cu_seqlens is None or inp.attention_mask is not None:
        raise ValueError("context parallelism shards packed rows only (actor.use_remove_padding, no shared_prefix)")
    if inp.cp_cols is not None:
        return inp
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    cols = local_columns(inp.cu_seqlens, cp, rank)
    take = lambda t: None if t is None else t[:, cols]
    return dataclasses.replace(
        inp, tokens=take(inp.tokens), position_ids=take(inp.position_ids), labels=take(inp.labels),
        routed_experts=take(inp.routed_experts), cp_cols=cols, cp_order=global_order(inp.cu_seqlens, cp),
        cp_group=group, cp_full_len=int(inp.tokens.shape[1]))


def prompt_group_ids(mb: TrainBatch) -> Tensor:
    """[B] int64: samples with the same prompt (valid prompt tokens and their positions) share an id."""
    pam = mb.attention_mask[:, : mb.prompt_length].bool()
    P = mb.prompt_length
    key = torch.cat([mb.input_ids[:, :P] * pam, mb.position_ids[:, :P] * pam, pam.long()], 1)
    return torch.unique(key, dim=0, return_inverse=True)[1]


def split_by_prompt(mb: TrainBatch, micro_batch_size: int) -> list[list[int]]:
    """:func:`split_by_length` for the shared-prefix layout: the samples of one prompt stay adjacent
    (groups ordered by their longest sample, members by length), so a fixed cut splits as few
    groups as possible and each micro-batch computes each of its prompts once."""
    lengths, grp = mb.seq_lengths().tolist(), prompt_group_ids(mb).tolist()
    longest: dict[int, int] = {}
    for g, n in zip(grp, lengths):
        longest[g] = max(longest.get(g, 0), n)
    order = sorted(range(len(grp)), key=lambda i: (longest[grp[i]], grp[i], lengths[i], i))
    return [[order[i] for i in p] for p in split_fixed(len(order), micro_batch_size)]


def build_shared_prefix_inputs(mb: TrainBatch, *, pad_to_multiple: int = 1) -> ModelInputs:
    """Inputs that compute each prompt once for all of its samples (GRPO's n samples per prompt).

    One row per prompt group: the prompt's tokens, then one *segment* per sample — the sample's
    response but its last token::

        [p_0 … p_{P-1} | r^1_0 … r^1_{m1-1} | r^2_0 … r^2_{m2-1} | … | pad]

    A segment attends to the prompt and causally to itself only (``attention_mask``), and its tokens
    keep the positions they have in the sample's own sequence (``position_ids``), so every response
    token is predicted from exactly the context and positions it has in the compact layout — the same
    log-probs up to the float order of the matmuls. The prompt's last column predicts every sample's
    first response token (one column, n labels: ``first_col``/``first_label``, read by
    :meth:`ModelInputs.first_token_logits`); segment column k predicts response token k + 1
    (``labels``). A response's last token predicts nothing, so it is no input. Tokens per group of n
    samples: P + Σ (r_i − 1) instead of n·P + Σ r_i.

    Needs the model to apply RoPE at ``position_ids`` and the attention to take ``attention_mask``
    (:meth:`mrl.workers.megatron_model.MegatronModel.run` does both); Megatron's local attention spec, not
    Transformer Engine's fused causal kernels.
    """
    am = mb.attention_mask.bool()
    B = am.shape[0]
    P = mb.prompt_length
    pam, rv = am[:, :P], am[:, P:]
    p_len, r_len = pam.sum(-1), rv.sum(-1)
    if bool((p_len == 0).any()):
        bad = torch.nonzero(p_len == 0).flatten().tolist()
        raise ValueError(f"samples {bad} have an empty prompt (attention_mask[:, :P] all 0)")
    grp = prompt_group_ids(mb)
    G = int(grp.max()) + 1
    # Segment starts: after the group's prompt (p tokens), the segments of the group's earlier samples.
    seg_len = (r_len - 1).clamp(min=0)
    order = torch.argsort(grp * B + torch.arange(B))  # by group, then sample index
    excl = torch.cumsum(seg_len[order], 0) - seg_len[order]
    first = torch.zeros(G, dtype=torch.long).scatter_reduce(0, grp[order], excl, "amin", include_self=False)
    seg_start = torch.empty(B, dtype=torch.long)
    seg_start[order] = p_len[order] + excl - first[grp[order]]
    row_len = torch.zeros(G, dtype=torch.long).scatter_reduce(0, grp, seg_start + seg_len, "amax", include_self=False)
    L = int(row_len.max())
    L = ((L + pad_to_multiple - 1) // pad_to_multiple) * pad_to_multiple
    tokens = torch.zeros(G, L, dtype=torch.long)
    pos = torch.zeros(G, L, dtype=torch.long)
    seg = torch.full((G, L), -1, dtype=torch.long)  # -1: padding, 0: prompt, i + 1: sample i's segment
    # prompt: its valid tokens from column 0 (every member of the group writes the same values)
    pcol = torch.arange(P)[None, :] - (P - p_len)[:, None]
    k = rv.long().cumsum(-1)  # 1-based rank of each valid response token
    rcol = seg_start[:, None] + k - 1  # where response token k is an input (k < r)
    ids, ps_ = mb.input_ids, mb.position_ids
    rids = ids[:, P:]
    sample_seg = (torch.arange(B) + 1)[:, None]
    for sel, c, t, p, s_ in (
        (pam, pcol, ids[:, :P], ps_[:, :P], torch.zeros(B, P, dtype=torch.long)),
        (rv & (k < r_len[:, None]), rcol, rids, ps_[:, P:], sample_seg.expand_as(rv)),
    ):
        r = grp[:, None].expand_as(sel)
        tokens[r[sel], c[sel]] = t[sel]
        pos[r[sel], c[sel]] = p[sel]
        seg[r[sel], c[sel]] = s_[sel]
    # response token k >= 2 is predicted by the column holding token k − 1; the first one by the prompt's last
    first_col = p_len - 1
    resp_first, later = rv & (k == 1), rv & (k > 1)
    resp_index = torch.where(later, rcol - 1, first_col[:, None])
    first_label = (rids * resp_first).sum(-1)
    labels = torch.zeros_like(tokens)  # columns that predict no segment token keep label 0 (never read)
    labels[grp[:, None].expand_as(rv)[later], resp_index[later]] = rids[later]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    attend = causal[None] & ((seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == 0))  # [G, q, k]
    return ModelInputs(tokens, pos, labels, resp_index, rv, row_len, attention_mask=~attend[:, None],
                       resp_row=grp, first_col=first_col, first_label=first_label, resp_first=resp_first)
