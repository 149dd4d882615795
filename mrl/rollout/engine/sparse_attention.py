"""DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) in the engine: transformers' own forward over the running set.

Per token and layer the model caches three things (transformers 5.25's ``DynamicIndexedLayer``): MLA's latent
``c_kv`` (``kv_lora_rank``, the cache's keys), the rotated shared key ``k_pe`` (``qk_rope_head_dim``, its values)
and the lightning indexer's key (``index_head_dim``, its ``indexer_keys``). The running set keeps them in its one
K/V pair per layer: keys = the latent, values = ``[k_pe | indexer key]`` (one "head"), so rows move, grow and
repeat as for any model. A decode step builds a ``DynamicCache(config=...)`` on copies of the live columns (as
:func:`mrl.rollout.engine.decode.hf_decode` does for DeepSeek-V3: O(live columns) copy per step, no paged cache),
runs the model's forward — whose indexer scores the new token against every cached indexer key and keeps its
top-k — and writes the new column back. Left-padded prefill is exact: the padding mask enters the indexer's scores
(``-inf`` / dtype-min at pads), so a pad is never chosen over a real token, and a chosen pad stays masked.
``tests/rollout/test_engine_dsa.py`` checks generation against transformers' ``generate`` per prompt.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from mrl.rollout.engine.kv_cache import RunningBatch

INDEXED = "indexed_attention"


def is_sparse_attention(config: Any) -> bool:
    """Every layer of ``config`` is DeepSeek sparse attention (transformers names them ``indexed_attention``)."""
    types = getattr(config, "layer_types", None) or []
    return bool(types) and all(t == INDEXED for t in types)


def value_dim(config: Any) -> int:
    """Width of the running set's values per token: MLA's rotated shared key, then the indexer's key."""
    return int(config.qk_rope_head_dim) + int(config.index_head_dim)


def take_prefill(cache: DynamicCache, pad: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(keys, values) per layer of a prefill's cache in the running set's layout; padding columns zeroed
    (``pad`` [B, L] True at padding) so no NaN can leak through 0 * NaN."""
    keys, values = [], []
    for layer in cache.layers:
        value = torch.cat([layer.values, layer.indexer_keys[:, None]], dim=-1)
        keys.append(layer.keys.masked_fill(pad[:, None, :, None], 0.0))
        values.append(value.masked_fill(pad[:, None, :, None], 0.0))
    return keys, values


def sparse_attention_decode(model: torch.nn.Module, rb: RunningBatch) -> torch.Tensor:
    """One decode step of the running set through the model's forward (module docstring): logits [B, V]."""
    rope = int(model.config.qk_rope_head_dim)
    col = rb.reserve_column()
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        value = rb.values(i)
        cache.update(rb.keys(i), value[..., :rope], i)
        layer.update_indexer(value[:, 0, :, rope:])
    mask = torch.cat([rb.valid_mask(), torch.ones(rb.size, 1, dtype=torch.long, device=rb.device)], dim=1)
    out = model(input_ids=rb.last_tokens[:, None], attention_mask=mask, position_ids=rb.next_pos[:, None],
                past_key_values=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        rb.k[i][: rb.size, :, col] = layer.keys[:, :, -1]
        rb.v[i][: rb.size, :, col] = torch.cat([layer.values[:, :, -1], layer.indexer_keys[:, None, -1]], dim=-1)
    rb.bias[: rb.size, col] = 0.0
    rb.commit_column()
    return out.logits[:, -1, :]
