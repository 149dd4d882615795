"""The engine's model: a ``transformers`` causal LM holding HF names; prefill and decode of the
running set.

The running set's KV cache is :class:`~mrl.rollout.engine.kv_cache.RunningBatch` (preallocated,
right-aligned rows: every decode step is one batched ``[B, 1]`` forward whose linear layers see no
padding; padding exists only in the attention over the cache and is bounded by the spread of
lengths of the sequences *currently* running). New requests are prefilled together (one
left-padded forward of the model) and added to the running set between decode steps. The decode
step is :mod:`mrl.rollout.engine.decode`; for a hybrid model (Gated DeltaNet linear-attention layers, whose
per-row conv window and recurrent state ride along as row states) :mod:`mrl.rollout.engine.hybrid`; for DeepSeek sparse
attention (the indexer's keys ride in the values) :mod:`mrl.rollout.engine.sparse_attention`. A
vision-language checkpoint is loaded whole (:func:`mrl.rollout.engine.vlm.load_model`), so its weights keep the
checkpoint's names (``model.language_model.layers.{i}...``).

Positions are counted per row (``next_pos``), so a row's logits do not depend on its padding:
log-probs agree with an unpadded transformers forward of the same tokens to ~1e-6 in fp32.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, DynamicCache

from mrl.dtypes import DTYPES, torch_dtype
from mrl.rollout.engine.decode import LlamaFamilyDecoder, fast_path_refusal, hf_decode
from mrl.rollout.engine.hybrid import HybridLayout, hybrid_decode
from mrl.rollout.engine.kv_cache import PrefilledRows, RunningBatch
from mrl.rollout.engine.moe import RoutingCapture, checkpoint_views, is_moe
from mrl.rollout.engine.sparse_attention import (
    is_sparse_attention,
    sparse_attention_decode,
    value_dim,
)
from mrl.rollout.engine.sparse_attention import take_prefill as take_sparse_prefill
from mrl.rollout.engine.vlm import (
    VisionInputs,
    VisionProcessor,
    is_vision_language,
    load_model,
    prefill_inputs,
)


def parse_dtype(name: str) -> torch.dtype:
    """A dtype as SGLang's protocol names it (``bfloat16``, ``torch.bfloat16``); not the short forms."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)}")
    return torch_dtype(key)  # one dtype table for the whole project (mrl.dtypes)


def kv_cache_shape(cfg) -> tuple[int, int, int, int]:
    """(layers, kv heads, key dim, value dim) of what transformers' cache holds per token and layer: K and V per
    KV head; for multi-latent attention (DeepSeek-V3) one "head" holding the latent (kv_lora_rank) as keys and
    the rotated shared key (qk_rope_head_dim) as values."""
    if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_rope_head_dim", None):
        return int(cfg.num_hidden_layers), 1, int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (int(cfg.num_hidden_layers), int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
            int(head_dim), int(head_dim))


class ModelRunner:
    """Loads ``model_path`` (config, safetensors, optional tokenizer) and runs prefill/decode.

    ``capture_routing`` (an MoE model only; ``--enable-return-routed-experts``): :attr:`routing` hooks the
    routers, and a prefill/decode called with ``routing=True`` leaves the top-k expert ids of the tokens it
    fed in :attr:`last_routing` (see :meth:`prefill`, :meth:`decode`)."""

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32",
                 capture_routing: bool = False) -> None:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"--model {model_path}: no config.json there; pass a Hugging Face checkpoint directory"
            )
        self.model_path = str(path)
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.config = AutoConfig.from_pretrained(path)
        # a vision-language checkpoint: its pictures' processor and *ForConditionalGeneration (engine/vlm.py); without
        # its preprocessor_config.json it serves text only (Qwen3.5 trained on text: the tower is carried, unused)
        self.vision = (VisionProcessor(path, self.config)
                       if is_vision_language(self.config) and (path / "preprocessor_config.json").is_file() else None)
        self.model = load_model(path, self.config, self.dtype).to(self.device).eval()
        self.tokenizer = None
        if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        text_cfg = self.config.get_text_config()  # the config itself, but for multimodal wrappers
        eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            eos = getattr(text_cfg, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        # Read once: a transformers config attribute costs microseconds, and the scheduler checks these for
        # every request and every sampled token.
        self.max_positions = int(getattr(text_cfg, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(text_cfg.vocab_size)
        self.released = False
        # By checkpoint name (what updates send; fused MoE experts split per expert, mrl/rollout/engine/moe.py),
        # and by parameter for resume().
        self._meta = {n: (p.dtype, tuple(p.shape)) for n, p in checkpoint_views(self.model).items()}
        self._param_meta = {n: (p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()}
        if capture_routing and not is_moe(self.config):
            raise ValueError(f"--enable-return-routed-experts: {model_path} is not a mixture-of-experts model "
                             f"(model_type {getattr(self.config, 'model_type', None)!r}); drop the flag")
        self.routing = RoutingCapture(self.model) if capture_routing else None
        self.last_routing: list[torch.Tensor] | torch.Tensor | None = None
        self._kv_shape = kv_cache_shape(text_cfg)
        self.hybrid = HybridLayout.of(self.config)  # linear-attention layers: conv window + recurrent state per row
        # DeepSeek sparse attention: the indexer's keys ride in the values (engine/sparse_attention.py)
        self.sparse = is_sparse_attention(text_cfg)
        if self.sparse:
            self._kv_shape = (*self._kv_shape[:3], value_dim(text_cfg))
        if self.hybrid is not None:
            self._kv_shape = (len(self.hybrid.full), *self._kv_shape[1:])  # K/V for the full-attention layers only
        # The written-out decode step for the families it knows; the model's own forward otherwise.
        # a vision-language model: its decoder sits under model.language_model and its forward owns the mRoPE
        # (a hybrid, vision-language or not, names its recurrent state: fast_path_refusal checks that first)
        self.decode_path = (fast_path_refusal(self.config) if self.vision is None or self.hybrid is not None
                            else "vision-language model")
        self._decoder = LlamaFamilyDecoder(self.model) if self.decode_path is None else None
        self.decode_path = "fast" if self.decode_path is None else f"transformers forward ({self.decode_path})"

    def new_batch(self) -> RunningBatch:
        """An empty running set whose cache fits this model."""
        layers, heads, key_dim, value_dim = self._kv_shape
        states = self.hybrid.row_states(self.dtype) if self.hybrid is not None else ()
        return RunningBatch(layers, heads, key_dim, dtype=self.dtype, device=self.device, value_dim=value_dim,
                            row_states=states)

    # ---- weights by HF name -------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every weight under its HF checkpoint name(s) (tied weights under both; a fused MoE expert
        parameter as one writable view per expert: :func:`~mrl.rollout.engine.moe.checkpoint_views`)."""
        return checkpoint_views(self.model)

    def weight_meta(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{HF name: (dtype, shape)}, valid also while the weights are released."""
        return dict(self._meta)

    # ---- forward ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], routing: bool = False,
                vision: list[VisionInputs | None] | None = None) -> tuple[PrefilledRows, torch.Tensor]:
        """Left-padded batched prefill. Returns the new rows' cache (for ``RunningBatch.add``) and
        the logits of each prompt's last position [N, V]. ``routing`` (needs ``capture_routing``):
        :attr:`last_routing` becomes one int32 ``[len(prompt), num_layers, top_k]`` per prompt, the
        experts each prompt token was routed to.

        Identical prompts are computed once and their rows copied: the rollout client sends the n
        samples of a prompt together, so an RL admission is mostly n-fold repeats (SGLang reuses
        them from its prefix cache). ``vision`` (a vision-language model): each prompt's pictures
        (engine/vlm.py), part of what makes two prompts identical."""
        vision = vision if vision is not None and any(v is not None for v in vision) else None
        keys = [tuple(p) if vision is None else (tuple(p), None if vision[i] is None else vision[i].digest)
                for i, p in enumerate(prompts)]
        first: dict[tuple, int] = {}
        index = [first.setdefault(k, len(first)) for k in keys]
        self._arm(routing)
        if len(first) == len(prompts):
            out = self._prefill(prompts, vision)
            self._take_prefill_routing(prompts, list(range(len(prompts))))
            return out
        at = {k: i for i, k in reversed(list(enumerate(keys)))}  # the first row of each key
        uniq = [list(prompts[at[k]]) for k in first]
        rows, logits = self._prefill(uniq, None if vision is None else [vision[at[k]] for k in first])
        self._take_prefill_routing(uniq, index)
        idx = torch.tensor(index, device=self.device)
        return rows.select(idx), logits.index_select(0, idx)  # K/V and any row states (hybrid) alike

    def _prefill(self, prompts: list[list[int]], vision: list[VisionInputs | None] | None = None
                 ) -> tuple[PrefilledRows, torch.Tensor]:
        n, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(n, L, dtype=torch.long)
        mask = torch.zeros(n, L, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, L - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        next_pos, extra = torch.tensor([len(p) for p in prompts], dtype=torch.long), {}
        if self.vision is not None:  # multimodal RoPE positions and the pictures (engine/vlm.py)
            pos, next_pos, extra = prefill_inputs(self.model, ids.to(self.device), mask.to(self.device),
                                                  vision or [None] * n, self.vision.image_token_id)
        elif vision is not None:
            raise ValueError("image_data needs a vision-language model with its image processor "
                             "(preprocessor_config.json); this engine serves text only")
        # A hybrid's cache has a linear-attention layer per linear layer (built from the config); a plain
        # DynamicCache() replicates K/V layers (given a config it would also window sliding-window layers' K/V).
        cache = DynamicCache(config=self.model.config) if self.hybrid is not None or self.sparse else DynamicCache()
        out = self.model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            position_ids=pos.to(self.device), past_key_values=cache, use_cache=True,
            logits_to_keep=1,  # only the last position is sampled: skip V x T of lm_head work
            **extra,
        )
        pad = (mask == 0).to(self.device)
        states: list[torch.Tensor] = []
        if self.hybrid is not None:
            keys, values, states = self.hybrid.take_prefill(cache, pad)
        elif self.sparse:
            keys, values = take_sparse_prefill(cache, pad)
        else:
            keys, values = [], []
            for layer in cache.layers:
                # Padding rows attend to nothing; zero their K/V so no NaN can leak through 0*NaN.
                keys.append(layer.keys.masked_fill(pad[:, None, :, None], 0.0))
                values.append(layer.values.masked_fill(pad[:, None, :, None], 0.0))
        rows = PrefilledRows(keys, values, mask.to(self.device),
                             next_pos=next_pos, states=states)
        return rows, out.logits[:, -1, :]

    def decode(self, rb: RunningBatch, routing: bool = False) -> torch.Tensor:
        """Feed ``rb.last_tokens`` at ``rb.next_pos``; returns logits [B, V] and advances ``rb``.
        ``routing``: :attr:`last_routing` becomes int32 ``[B, num_layers, top_k]``, the experts of each
        fed token."""
        self._arm(routing)
        if self._decoder is not None:
            logits = self._decoder(rb)
        elif self.hybrid is not None:
            logits = hybrid_decode(self.model, rb, self.hybrid)
        elif self.sparse:
            logits = sparse_attention_decode(self.model, rb)
        else:
            logits = hf_decode(self.model, rb)
        if routing:
            self.last_routing = self.routing.take(rb.size)  # type: ignore[union-attr]
        return logits

    def _arm(self, routing: bool) -> None:
        self.last_routing = None
        if self.routing is not None:
            self.routing.armed = False  # a forward that raised may have left it armed
        if routing:
            if self.routing is None:
                raise ValueError("routed experts were asked for, but this engine was started without "
                                 "--enable-return-routed-experts")
            self.routing.arm()

    def _take_prefill_routing(self, computed: list[list[int]], index: list[int]) -> None:
        """The armed prefill's ids ([n * Lp] rows: prompt-major, left-padded) cut to each prompt's tokens."""
        if self.routing is None or not self.routing.armed:
            return
        lp = max(len(p) for p in computed)
        ids = self.routing.take(len(computed) * lp).view(len(computed), lp, self.routing.num_layers,
                                                          self.routing.top_k)
        self.last_routing = [ids[k, lp - len(computed[k]):] for k in index]

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
            dtype, shape = self._param_meta[name]
            p.data = torch.zeros(shape, dtype=dtype, device=self.device)
        self.released = False


def list_safetensors(model_path: str) -> list[str]:
    files = sorted(os.path.join(model_path, f) for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"model_path {model_path}: no *.safetensors files; save with save_pretrained(safe_serialization=True)"
        )
    return files
