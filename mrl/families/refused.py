"""Architectures users bring that mrl recognises but cannot build yet, and why (no family module owns
them; :func:`mrl.families.family_of` raises with the reason)."""
from __future__ import annotations

REFUSED_ARCHITECTURES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 needs multi-latent attention, which mrl does not map yet",
    "Qwen3NextForCausalLM": "Qwen3-Next stores its Gated DeltaNet projections fused per key-head group "
                            "(in_proj_qkvz / in_proj_ba), which mrl does not map yet; Qwen3.5 / Qwen3.6 "
                            "(Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration) are supported",
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention (the lightning indexer's top-k) is not built yet",
    "GlmMoeDsaForCausalLM": "GLM-5's DeepSeek sparse attention (the lightning indexer's top-k) is not built yet",
}
