"""The Hugging Face architectures mrl trains (architecture -> family).

Its own module, without torch, so that ``mrl plan`` checks a checkpoint's ``config.json`` against it
(mrl/config/checkpoint_files.py) without importing the model code; the provider builds from it.
"""
from __future__ import annotations

from mrl.megatron.moe import MOE_ARCHITECTURES

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    **MOE_ARCHITECTURES,
}
