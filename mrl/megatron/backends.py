"""Which core attention a Megatron role runs (``megatron.attention_backend``): the rule, without torch.

Its own module so that ``mrl plan`` (mrl/config/auto.py) prints the very choice the ranks make
(:func:`mrl.megatron.provider.resolve_attention_backend`)::

    te     CUDA, Transformer Engine importable, no LoRA     TE's fused attention and layers
    sdpa   otherwise                                         torch SDPA in Megatron's local spec
                                                             (mrl/megatron/sdpa_attention.py)
    local  only when asked for                               Megatron's unfused DotProductAttention

LoRA's adapters wrap the local spec's unfused norm + linear, hence sdpa there. Multi-latent attention
(DeepSeek-V3) is built on the local spec with SDPA only (``local``'s DotProductAttention rejects its
d_k != d_v; TE's MLA layers fuse norms mrl's weight table does not name), hence sdpa there too.
"""
from __future__ import annotations

BACKENDS = ("te", "sdpa", "local")


def choose_attention_backend(want: str, *, device: str, te_importable: bool, lora: bool,
                             mla: bool = False, hybrid: bool = False) -> tuple[str, str]:
    """(backend, why) for ``want`` (auto | te | sdpa | local) on ``device``; an explicit value is kept as given
    (``mla``: the model has multi-latent attention; ``hybrid``: Gated DeltaNet layers)."""
    if want != "auto":
        return want, "set in the config"
    if hybrid:
        return "sdpa", "auto: hybrid Gated DeltaNet + attention layers run on Megatron's local spec with torch SDPA"
    if mla:
        return "sdpa", "auto: multi-latent attention runs on Megatron's local spec with torch SDPA"
    if device != "cuda":
        return "sdpa", f"auto: {device}, torch SDPA (flash kernel, no s x s scores)"
    if not te_importable:
        return "sdpa", "auto: Transformer Engine is not importable, torch SDPA (flash / memory-efficient / cuDNN kernels)"
    if lora:
        return "sdpa", "auto: LoRA adapters need Megatron's local layer spec, torch SDPA in it"
    return "te", "auto: Transformer Engine on CUDA, its fused attention"
