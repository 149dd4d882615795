"""The engine's model: a ``transformers`` causal LM holding HF names, and the KV cache of the
running set.

KV layout (why it is fast on CPU): the running set shares ONE ``DynamicCache`` whose rows are
the running sequences, right-aligned (left padding) so that every decode step is a single
batched forward of ``[B, 1]`` tokens: the linear layers, which dominate the cost, see no padding
at all. Padding exists only in the attention over the cache (``[B, L]`` mask) and is bounded by
the spread of lengths of the sequences *currently* running: finished rows are dropped from the
cache at once and the columns that became padding in every row are cut (``compact``). New
requests are prefilled together (one left-padded forward) and merged into the running cache
between decode steps. A per-sequence cache + re-padding on every step, or a paged cache with a
gather, would copy the whole cache each step; on CPU that copy costs more than the bounded
attention padding.

Positions are counted per row (``next_pos``), so a row's logits do not depend on its padding:
log-probs agree with an unpadded transformers forward of the same tokens to ~1e-6 in fp32.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


class RunningBatch:
    """Cache and per-row state of the running set. All tensors have B rows in ``reqs`` order."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [B, L] 1 = real cached token
        self.next_pos = torch.zeros(0, dtype=torch.long)  # [B] position of the token fed next
        self.last_tokens = torch.zeros(0, dtype=torch.long)  # [B] token fed at the next step

    @property
    def size(self) -> int:
        return int(self.next_pos.shape[0])

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in ``rows`` (order kept), then cut all-padding leading columns."""
        if len(rows) == 0:
            self.__init__()
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, idx)
        self.next_pos = self.next_pos.index_select(0, idx)
        self.last_tokens = self.last_tokens.index_select(0, idx)
        real = self.mask.any(dim=0).nonzero()
        start = int(real[0]) if real.numel() else self.mask.shape[1]
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:  # type: ignore[union-attr]
            layer.keys = layer.keys.index_select(0, idx)[:, :, start:]
            layer.values = layer.values.index_select(0, idx)[:, :, start:]

    def merge(self, other: RunningBatch) -> None:
        """Append ``other``'s rows; the shorter cache is left-padded with zeros (masked out)."""
        if self.size == 0:
            self.cache, self.mask, self.next_pos, self.last_tokens = other.cache, other.mask, other.next_pos, other.last_tokens
            return
        la, lb = self.mask.shape[1], other.mask.shape[1]
        L = max(la, lb)
        self.mask = torch.cat([_lpad(self.mask, L), _lpad(other.mask, L)], dim=0)
        for a, b in zip(self.cache.layers, other.cache.layers):  # type: ignore[union-attr]
            a.keys = torch.cat([_lpad(a.keys, L, dim=2), _lpad(b.keys, L, dim=2)], dim=0)
            a.values = torch.cat([_lpad(a.values, L, dim=2), _lpad(b.values, L, dim=2)], dim=0)
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.last_tokens = torch.cat([self.last_tokens, other.last_tokens])


def _lpad(t: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
    extra = length - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


class ModelRunner:
    """Loads ``model_path`` (config, safetensors, optional tokenizer) and runs prefill/decode."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32") -> None:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {model_path}: no config.json there; pass a Hugging Face checkpoint directory"
            )
        self.model_path = str(path)
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.config = AutoConfig.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        self.tokenizer = None
        if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        eos = self.config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        self.released = False
        self._meta = {n: (p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters(remove_duplicate=False)}

    # ---- weights by HF name -------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter under each of its HF names (tied weights appear under both)."""
        return dict(self.model.named_parameters(remove_duplicate=False))

    def weight_meta(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{HF name: (dtype, shape)}, valid also while the weights are released."""
        return dict(self._meta)

    # ---- forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[RunningBatch, torch.Tensor]:
        """Left-padded batched prefill. Returns the new rows' batch state (last_tokens unset) and
        the logits of each prompt's last position [N, V]."""
        n, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(n, L, dtype=torch.long)
        mask = torch.zeros(n, L, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, L - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device), past_key_values=cache, use_cache=True,
            logits_to_keep=1,  # only the last position is sampled: skip V x T of lm_head work
        )
        pad = (mask == 0).to(self.device)
        if pad.any():
            # Padding rows attend to nothing; zero their K/V so no NaN can leak through 0*NaN.
            for layer in cache.layers:
                layer.keys.masked_fill_(pad[:, None, :, None], 0.0)
                layer.values.masked_fill_(pad[:, None, :, None], 0.0)
        rb = RunningBatch()
        rb.cache, rb.mask = cache, mask.to(self.device)
        rb.next_pos = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        rb.last_tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        return rb, out.logits[:, -1, :]

    @torch.inference_mode()
    def decode(self, rb: RunningBatch) -> torch.Tensor:
        """Feed ``rb.last_tokens`` at ``rb.next_pos``; returns logits [B, V] and advances ``rb``."""
        B = rb.size
        mask = torch.cat([rb.mask, torch.ones(B, 1, dtype=torch.long, device=rb.mask.device)], dim=1)
        out = self.model(
            input_ids=rb.last_tokens[:, None], attention_mask=mask, position_ids=rb.next_pos[:, None],
            past_key_values=rb.cache, use_cache=True,
        )
        rb.mask = mask
        rb.next_pos = rb.next_pos + 1
        return out.logits[:, -1, :]

    # ---- memory release -----------------------------------------------------------------
    def release(self) -> int:
        """Drop every parameter's storage (shapes/dtypes kept in ``_meta``); returns bytes freed.
        Tied parameters are one object, so the tie survives release/resume."""
        freed = 0
        for p in self.model.parameters():
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released = True
        return freed

    def resume(self) -> None:
        """Re-allocate every parameter with zeros; the caller reloads values (disk or sync)."""
        for name, p in self.model.named_parameters():
            dtype, shape = self._meta[name]
            p.data = torch.zeros(shape, dtype=dtype, device=self.device)
        self.released = False


def list_safetensors(model_path: str) -> list[str]:
    files = sorted(os.path.join(model_path, f) for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"model_path {model_path}: no *.safetensors files; save with save_pretrained(safe_serialization=True)"
        )
    return files
