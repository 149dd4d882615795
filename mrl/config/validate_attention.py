"""Cross-section rules of the attention backend and packed micro-batches (part of the one validation layer,
:mod:`mrl.config.validate`).

What each setting needs (the ``auto`` rules: :mod:`mrl.config.auto`):

* ``<role>.megatron.attention_backend=te``: CUDA, Transformer Engine installed, no LoRA on that role.
* ``actor.use_remove_padding=true``: every packing role (actor, ref, critic, teacher; the reward model scores
  compact rows) on ``sdpa`` (mrl's SDPA module applies the packed
  rows' sequence boundaries; the ``local`` attention takes dense masks only and TE's THD path is not wired),
  and not together with ``actor.shared_prefix=true`` (two row layouts).
* ``actor.shared_prefix=true``: the actor's attention applies an arbitrary mask (``sdpa`` or ``local``, not
  TE's causal kernels).
"""
from __future__ import annotations

from mrl.config.auto import (
    POLICY_ROLES,
    choose_attention_backend,
    megatron_roles,
    model_is_mla,
    packing_blockers,
    te_importable_here,
)
from mrl.config.root import MRLConfig


def check_attention(cfg: MRLConfig, cuda: bool, errors: list[str]) -> None:
    device = "cuda" if cuda else "cpu"
    te, model_mla = te_importable_here(), model_is_mla(cfg)
    resolved = {}
    for role, par, lora in megatron_roles(cfg):
        key = f"{role}.megatron.attention_backend"
        mla = model_mla and role in POLICY_ROLES
        if mla and par.attention_backend in ("te", "local"):
            errors.append(f"{key}={par.attention_backend} with {cfg.model.path}'s multi-latent attention: mrl builds "
                          f"it on Megatron's local spec with SDPA only; fix: {key}=sdpa (or auto)")
        if par.attention_backend == "te":
            if not cuda:
                errors.append(f"{key}=te: Transformer Engine runs on CUDA only, this run is on {device}; fix: "
                              f"{key}=sdpa (or auto)")
            elif not te:
                errors.append(f"{key}=te but Transformer Engine is not installed here (import transformer_engine "
                              f"fails); fix: {key}=sdpa (or auto), or run in mrl's image, which has it (docs/gpus.md)")
            if lora:
                errors.append(f"{key}=te with actor.lora: the adapters need Megatron's local layer spec; fix: "
                              f"{key}=sdpa (or auto)")
        resolved[role] = choose_attention_backend(par.attention_backend, device=device, te_importable=te,
                                                  lora=lora, key=key, mla=mla)
    a = cfg.actor
    if a.use_remove_padding is True:
        if a.shared_prefix is True:
            errors.append("actor.use_remove_padding=true with actor.shared_prefix=true: two row layouts for the same "
                          "micro-batches; fix: keep one (shared_prefix computes each prompt once, packing removes "
                          "padding)")
        for c in packing_blockers(list(resolved.values())):
            errors.append(f"actor.use_remove_padding=true needs every packing role on the sdpa attention backend, "
                          f"but {c.key} resolves to {c.value} ({c.why}); fix: {c.key}=sdpa, or "
                          "actor.use_remove_padding=false")
    if a.shared_prefix is True and resolved["actor"].value == "te":
        errors.append("actor.shared_prefix=true needs attention that applies the per-sample mask, but "
                      f"actor.megatron.attention_backend resolves to te ({resolved['actor'].why}), whose causal "
                      "kernels ignore it; fix: actor.megatron.attention_backend=sdpa, or actor.shared_prefix=false")
