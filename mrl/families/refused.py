"""Architectures users bring that mrl recognises but cannot build yet, and why (no family module owns
them; :func:`mrl.families.family_of` raises with the reason)."""
from __future__ import annotations

REFUSED_ARCHITECTURES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 needs multi-latent attention, which mrl does not map yet",
}
