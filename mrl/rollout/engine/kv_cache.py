"""KV cache of the running set: preallocated per-layer buffers, right-aligned rows.

Layout: layer ``i`` holds ``k[i]``, ``v[i]`` of shape ``[rows_cap, kv_heads, cols_cap, head_dim]`` (``v``'s last
dim ``value_dim`` when it differs: transformers' DeepSeek-V3 caches its MLA latent ``[.., 1, .., kv_lora_rank]``
as keys and the rotated shared key ``[.., 1, .., qk_rope_head_dim]`` as values).
The ``B`` running sequences are rows ``0..B-1``; every row is right-aligned so that all of them
end at column ``end`` and the next token of every row is written into the same column. That is
what makes a decode step one batched forward of ``[B, 1]`` tokens whose linear layers see no
padding. ``bias[b, c]`` is 0 where row ``b`` holds a real token and ``-inf`` where it is padding
(left of its prompt), the additive attention mask. The live columns are ``start..end-1``:
``start`` is the first column any live row uses.

Why preallocated and swap-remove (docs/performance.md, 'Preallocated KV cache': the previous
``DynamicCache`` concatenated every layer's whole cache on every step): appending writes one column
in place; a finished row is replaced by the last row
(one row copied, not the cache); leading all-padding columns are dropped by moving ``start``.
Buffers are reallocated (live region copied once) only when rows or columns run out, with
headroom so that this happens every ``COL_HEADROOM`` steps at most.

The buffers are inference tensors: every method that writes them runs under
``torch.inference_mode`` (so do the decode steps).

Row order changes on removal; :meth:`RunningBatch.remove` returns the new order so the owner
can permute its per-request state the same way.

Row states (hybrid models, :mod:`mrl.rollout.engine.hybrid`): fixed-size tensors per row that are no cache
columns, e.g. a Gated DeltaNet layer's conv window ``[conv_dim, kernel - 1]`` and recurrent state
``[heads_v, d_k, d_v]``. Each is one buffer ``s[j]`` of ``[rows_cap, *shape]`` that moves with its row: written by
:meth:`RunningBatch.add`, copied by the swap-remove, carried over by a reallocation. What they mean is the
owner's business; here they are rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

COL_HEADROOM = 64  # free columns added on reallocation (steps between two reallocations)


class PrefilledRows(NamedTuple):
    """Cache of ``n`` prompts prefilled together, right-aligned: ``keys[i]``/``values[i]``
    ``[n, kv_heads, Lp, D]`` per layer, ``valid`` ``[n, Lp]`` (1 = real token), ``next_pos`` ``[n]``;
    ``states[j]`` ``[n, *shape_j]`` per row state (none for a model without them)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    next_pos: torch.Tensor
    states: Sequence[torch.Tensor] = ()

    def select(self, idx: torch.Tensor) -> PrefilledRows:
        """Rows ``idx`` (repeats allowed: identical prompts computed once, one row each)."""
        return PrefilledRows([k.index_select(0, idx) for k in self.keys], [v.index_select(0, idx) for v in self.values],
                             self.valid.index_select(0, idx), self.next_pos.index_select(0, idx.to(self.next_pos.device)),
                             [s.index_select(0, idx) for s in self.states])


class RunningBatch:
    """Cache and per-row state of the running set (``B`` rows in the owner's request order)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, value_dim: int | None = None,
                 row_states: Sequence[tuple[tuple[int, ...], torch.dtype]] = ()) -> None:
        self.shape = (num_layers, kv_heads, head_dim)
        self.value_dim = head_dim if value_dim is None else value_dim
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        # one [rows_cap, *shape] buffer per row state (see the module docstring)
        self.s = [torch.zeros(0, *shape, dtype=dt, device=device) for shape, dt in row_states]
        self.bias = torch.zeros(0, 0, dtype=dtype, device=device)
        self.size = 0
        self.start = self.end = 0
        self.next_pos = torch.zeros(0, dtype=torch.long, device=device)  # [B] position of the token fed next
        self.last_tokens = torch.zeros(0, dtype=torch.long, device=device)  # [B] token fed at the next step

    # ---- views ---------------------------------------------------------------------------
    @property
    def rows_cap(self) -> int:
        return int(self.bias.shape[0])

    @property
    def cols_cap(self) -> int:
        return int(self.bias.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.s, self.bias))

    def keys(self, layer: int, end: int | None = None) -> torch.Tensor:
        """``[B, kv_heads, L, head_dim]`` view of the live columns (``end`` overrides ``self.end``)."""
        return self.k[layer][: self.size, :, self.start: self.end if end is None else end]

    def values(self, layer: int, end: int | None = None) -> torch.Tensor:
        return self.v[layer][: self.size, :, self.start: self.end if end is None else end]

    def state(self, j: int) -> torch.Tensor:
        """``[B, *shape]`` view of row state ``j`` of the live rows (written in place by the decode step)."""
        return self.s[j][: self.size]

    def attn_bias(self, end: int | None = None) -> torch.Tensor:
        """``[B, L]`` additive mask of the live columns: 0 = real token, -inf = padding."""
        return self.bias[: self.size, self.start: self.end if end is None else end]

    def valid_mask(self, end: int | None = None) -> torch.Tensor:
        """``[B, L]`` int64 attention mask (1 = real token) of the live columns."""
        return (self.attn_bias(end) == 0).long()

    # ---- growth --------------------------------------------------------------------------
    def _realloc(self, rows: int, width: int) -> None:
        """New buffers with room for ``rows`` rows and ``width`` live columns (+ headroom); the
        live region is copied right-aligned so that it ends at column ``width``."""
        n_layers, kvh, hd = self.shape
        live = self.end - self.start
        assert width >= live
        cols = width + COL_HEADROOM
        rows = max(rows, 1)
        new_end = width
        new_start = new_end - live
        b = self.size
        k = [torch.zeros(rows, kvh, cols, hd, dtype=self.dtype, device=self.device) for _ in range(n_layers)]
        v = [torch.zeros(rows, kvh, cols, self.value_dim, dtype=self.dtype, device=self.device) for _ in range(n_layers)]
        bias = torch.full((rows, cols), float("-inf"), dtype=self.dtype, device=self.device)
        if b and live:
            for i in range(n_layers):
                k[i][:b, :, new_start:new_end] = self.k[i][:b, :, self.start: self.end]
                v[i][:b, :, new_start:new_end] = self.v[i][:b, :, self.start: self.end]
            bias[:b, new_start:new_end] = self.bias[:b, self.start: self.end]
        self.k, self.v, self.bias = k, v, bias
        self.start, self.end = new_start, new_end
        if any(t.shape[0] != rows for t in self.s):  # column growth alone leaves the row states where they are
            states = [torch.zeros(rows, *t.shape[1:], dtype=t.dtype, device=self.device) for t in self.s]
            for new, old in zip(states, self.s):
                new[:b] = old[:b]
            self.s = states

    @torch.inference_mode()
    def reserve_column(self) -> int:
        """Column the next decode step writes into (``end``); reallocates when it is full."""
        if self.end >= self.cols_cap:
            self._realloc(self.rows_cap, self.end - self.start)
        return self.end

    def commit_column(self) -> None:
        """After a decode step wrote column ``end`` of every live row."""
        self.end += 1
        self.next_pos = self.next_pos + 1

    # ---- rows ----------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, rows: PrefilledRows, last_tokens: torch.Tensor) -> None:
        """Append the ``n`` prefilled rows, whose next token is ``last_tokens`` ``[n]``. Their last
        column lands on ``end - 1`` (the running rows' last written column); the live region widens
        on the left when the prompts are longer than it."""
        keys, values, valid, next_pos = rows.keys, rows.values, rows.valid, rows.next_pos
        if len(rows.states) != len(self.s):
            raise ValueError(f"{len(rows.states)} row states prefilled, the running set holds {len(self.s)}")
        n, lp = valid.shape
        need_rows = self.size + n
        if self.size == 0 and need_rows <= self.rows_cap and lp < self.cols_cap:
            self.start = self.end = lp  # reuse the empty buffers
        elif self.end < lp or need_rows > self.rows_cap or self.end >= self.cols_cap:
            # Wider prompt than the live region, or out of rows/columns: copy once into new buffers
            # (50 % spare rows so that a stream of admissions does not reallocate every time).
            self._realloc(need_rows + need_rows // 2, max(self.end - self.start, lp))
        b0, b1 = self.size, self.size + n
        c0 = self.end - lp
        self.bias[b0:b1].fill_(float("-inf"))  # slots may hold a finished row's mask
        self.bias[b0:b1, c0: self.end].masked_fill_(valid.to(self.device).bool(), 0.0)
        for i in range(len(self.k)):
            self.k[i][b0:b1, :, c0: self.end] = keys[i]
            self.v[i][b0:b1, :, c0: self.end] = values[i]
        for buf, new in zip(self.s, rows.states):
            buf[b0:b1] = new
        self.start = min(self.start if self.size else c0, c0)
        self.size = b1
        self.next_pos = torch.cat([self.next_pos, next_pos.to(self.device)])
        self.last_tokens = torch.cat([self.last_tokens, last_tokens.to(self.device)])
        self._trim()

    @torch.inference_mode()
    def remove(self, rows: list[int]) -> list[int]:
        """Drop ``rows``; each freed slot below the new size takes the current last live row.
        Returns ``order``: new row ``j`` is old row ``order[j]``."""
        drop = set(rows)
        order = list(range(self.size))
        b = self.size
        for r in sorted(drop, reverse=True):  # descending: the last row moved in is never a dropped one
            b -= 1
            if r != b:
                order[r] = order[b]
                self._copy_row(b, r)
        order = order[:b]
        idx = torch.tensor(order, dtype=torch.long, device=self.device)
        self.next_pos = self.next_pos.index_select(0, idx)
        self.last_tokens = self.last_tokens.index_select(0, idx)
        self.size = b
        self._trim()
        return order

    def _copy_row(self, src: int, dst: int) -> None:
        s, e = self.start, self.end
        for i in range(len(self.k)):
            self.k[i][dst, :, s:e] = self.k[i][src, :, s:e]
            self.v[i][dst, :, s:e] = self.v[i][src, :, s:e]
        for buf in self.s:
            buf[dst] = buf[src]
        self.bias[dst] = self.bias[src]

    def _trim(self) -> None:
        """Move ``start`` past the columns that are padding in every live row."""
        if self.size == 0:
            self.start = self.end = 0
            return
        real = (self.bias[: self.size, self.start: self.end] == 0).any(dim=0).nonzero()
        self.start += int(real[0]) if real.numel() else self.end - self.start
