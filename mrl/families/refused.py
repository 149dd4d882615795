"""Architectures users bring that mrl recognises but cannot build yet, and why (no family module owns
them; :func:`mrl.families.family_of` raises with the reason)."""
from __future__ import annotations

REFUSED_ARCHITECTURES: dict[str, str] = {
    "DeepseekV3ForCausalLM": (
        "DeepSeek-V3 needs multi-latent attention, a sigmoid router with a score-correction bias, "
        "group-limited top-k and dense first layers; mrl's HF<->Megatron table has no MLA mapping "
        "and no transformers parity test for it yet"
    ),
    "DeepseekV2ForCausalLM": "DeepSeek-V2 needs multi-latent attention, which mrl does not map yet",
}
