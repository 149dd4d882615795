"""Megatron-Core model layer: HF config → GPTModel (provider), HF↔Megatron weights (mapping,
hf_io), CPU/gloo support (cpu_support, parallel), vocab-parallel log-probs, dist checkpoints.

Submodules import Megatron lazily; importing this package stays cheap. See docs/megatron.md.
"""

from mrl.megatron.import_hooks import install as _install_import_hooks

_install_import_hooks()  # Megatron's jit_fuser compiles on first use, not at import (import_hooks.py)
