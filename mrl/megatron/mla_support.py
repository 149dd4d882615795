"""megatron-core 0.16.1's multi-latent attention (``transformer/multi_latent_attention.py``) without
Transformer Engine.

That module imports ``TELinear``/``TEColumnParallelLinear`` from ``megatron.core.extensions.transformer_engine``,
which, without TE, still imports and leaves those names as ``MagicMock`` placeholders; the import succeeds, so
the module sets ``HAVE_TE = True`` and its constructor runs ``isinstance(self.linear_proj, TELinear)`` with a
placeholder that is not a type (``TypeError``), and compares the spec's linear classes against the
placeholders. :func:`ensure_megatron_mla_importable` replaces each placeholder that is not a class by a real
class no module is ever built from, so those checks answer "not a TE layer", which is true: mrl builds MLA on
Megatron's local spec (``ColumnParallelLinear``/``RowParallelLinear``). With TE installed the names are
TE's classes and are left alone.
"""
from __future__ import annotations

_NAMES = ("TELinear", "TEColumnParallelLinear")


def ensure_megatron_mla_importable() -> None:
    from megatron.core.transformer import multi_latent_attention as mla

    for name in _NAMES:
        if not isinstance(getattr(mla, name, None), type):
            # a class of its own per name: `spec_class in [TELinear]` must stay False for the local linears
            setattr(mla, name, type(f"{name}Absent", (), {"__doc__": f"{name} without Transformer Engine"}))
