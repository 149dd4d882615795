"""Do a checkpoint's weights fit its config.json? Checked from the safetensors headers before anything starts
(``mrl plan``, ``mrl train`` before Ray, ``mrl-ckpt`` before its ranks), with the standard library only.

The model the trainer, the engines and transformers build from config.json has fixed tensor shapes; a
config.json that is not the one the weights were saved with (hidden 128 over 64-wide tensors, 6 layers over
4, a vocabulary of 500 over 300 rows) otherwise fails only inside the ranks, as a reshape error. With ``H``
hidden, ``V`` vocab, ``n_h``/``n_kv`` heads/KV heads of width ``d``, ``I`` the dense MLP width, ``F_e`` one
routed expert's and ``F_s`` the shared expert's, ``E`` routed experts (transformers' module shapes)::

    embed_tokens, lm_head       [V, H]          norms                     [H]     q_norm, k_norm   [d]
    q_proj [n_h*d, H]  k_proj, v_proj [n_kv*d, H]  (biases [n_h*d], [n_kv*d])   o_proj          [H, n_h*d]
    gate_proj, up_proj [I, H]   down_proj [H, I]   (experts: F_e, shared expert: F_s)   router  [E, H]
    fused experts (gpt-oss)    [E, ...]

``d`` is config.json's ``head_dim``; without one, the width the query projection gives (rows / n_h), so that
k/v/o/q-norm are checked against it. Multi-latent attention (DeepSeek-V3) checks only ``o_proj``'s rows.

Tolerant by design: the names come from the family's weight rules (:mod:`mrl.families`), a tensor is checked
only when its rule is one of the kinds above (a gated ``q_proj``, Qwen3.5's ``qkv_gated``, has ``2*n_h*d`` rows;
linear-attention layers' own tensors are not checked), per-layer tensors that are absent are left to the loader,
and a vision-language checkpoint is read through its decoder view (:func:`mrl.families.views.decoder_dict`:
``text_config``, tensors under ``model.language_model.``; the vision tower is not checked). A config.json without
``tie_word_embeddings`` is untied, as transformers' config classes of every supported family default. What is refused:
a shape that differs; layers present in the weights that config.json does not have, or the reverse
(DeepSeek's multi-token-prediction layers, ``num_nextn_predict_layers``, excepted); a routed-expert count
different from config.json's; ``tie_word_embeddings: false`` without ``lm_head.weight`` (the trainer would
fill the head from the embedding while the engine runs another model); ``num_experts`` and
``num_local_experts`` both set and different (the plan would count one, the model build the other).
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

WEIGHTS_FIX = ("fix: put the config.json these weights were saved with next to them, or re-save the checkpoint "
               "(model.save_pretrained)")
# the per-problem sentences of weights_fit_problems are joined into one message line by this
_SHOWN = 3  # mismatching tensors named in the message (the first ones; the count says how many)


def describe(cfg: dict[str, Any]) -> str:
    """``Arch, L layers, hidden H, n heads`` of a config.json (the messages' summary of what it says)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    text = text_config(cfg)
    return (f"{arch}, {text.get('num_hidden_layers', '?')} layers, hidden {text.get('hidden_size', '?')}, "
            f"{text.get('num_attention_heads', '?')} heads")


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's view of config.json (:func:`mrl.families.views.decoder_dict`: a vision-language checkpoint's
    ``text_config``, its decoder tensors under ``model.language_model.``), as the provider and the mapping read it."""
    from mrl.families.views import decoder_dict

    return decoder_dict(cfg)


def _int(cfg: dict[str, Any], key: str) -> int | None:
    v = cfg.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def experts_conflict(cfg: dict[str, Any]) -> str | None:
    """Both expert-count keys set and different: transformers' config class reads one of them, mrl's plan the
    other; which one the model gets depends on the family, so the file must say one number."""
    c = text_config(cfg)
    a, b = c.get("num_experts"), c.get("num_local_experts")
    if a is not None and b is not None and a != b:
        return (f"config.json sets num_experts={a} and num_local_experts={b}: two different routed-expert counts "
                "(the memory plan and the EP checks would use one, the model another); fix: keep the one key the "
                "architecture uses (Qwen-MoE: num_experts, Mixtral/gpt-oss: num_local_experts) with the number of "
                "experts the weights hold, and delete the other")
    return None


class _Dims:
    """The numbers of config.json the shapes need (None where config.json does not say)."""

    def __init__(self, c: dict[str, Any], fam: Any, ns: Any) -> None:
        self.h, self.v = _int(c, "hidden_size"), _int(c, "vocab_size")
        self.nh = _int(c, "num_attention_heads")
        self.nkv = _int(c, "num_key_value_heads") or self.nh
        self.d = _int(c, "head_dim")
        self.i = _int(c, "intermediate_size")
        self.mla = fam.is_mla
        self.v_head = _int(c, "v_head_dim")
        self.e = self.fe = self.fs = None
        if fam.moe is not None:
            self.e = next((_int(c, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                           if _int(c, k)), None)
            self.fe = _call(fam.moe.expert_ffn_size, ns)
            self.fs = _call(fam.moe.shared_expert_size, ns)


def _call(fn: Any, ns: Any) -> Any:
    """A family function over config.json, None where it needs a key config.json does not hold."""
    try:
        return fn(ns)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _shape(rule: Any, k: int, name: str, dims: _Dims, fam: Any) -> tuple[tuple[int | None, ...], str] | None:
    """(expected shape, the config.json keys it comes from) of HF tensor ``name`` (the ``k``-th of ``rule``);
    None when this module does not derive it. ``None`` inside a shape: any size (``d`` unknown yet)."""
    h, d = dims.h, dims.d
    leaf = name.rsplit(".", 2)
    tail = ".".join(leaf[-2:])
    bias = name.endswith((".bias", "_bias"))  # gpt-oss names its fused experts' biases gate_up_proj_bias
    if rule.fused:
        return ((dims.e, None, None) if not bias else (dims.e, None)), "num_experts"
    if rule.split == "vocab":
        return (dims.v, h), "vocab_size, hidden_size"
    if rule.split in ("qkv", "qkv_gated") and not dims.mla and len(rule.hf) == 3:
        # qkv_gated (Qwen3.5's attention output gate): q_proj holds [q_h | g_h] per head, twice the rows
        gate = 2 if rule.split == "qkv_gated" and k == 0 else 1
        rows = gate * (dims.nh if k == 0 else dims.nkv) * d if d else None
        keys = "num_attention_heads" if k == 0 else "num_key_value_heads"
        return ((rows,) if bias else (rows, h)), f"{keys}, head_dim, hidden_size"
    if rule.split == "gate_up" and len(rule.hf) == 2 and not bias:
        f, key = _ffn(rule, dims)
        return (f, h), f"{key}, hidden_size"
    if rule.split == "row" and not bias and rule.mixer != "linear":  # (a Gated DeltaNet's out_proj: its own widths)
        if ".self_attn." in name or name.startswith("self_attn."):
            if dims.mla:  # o = o_proj (concat of the heads' values)
                cols = dims.nh * dims.v_head if dims.nh and dims.v_head else None
                return (h, cols), "hidden_size, num_attention_heads, v_head_dim"
            return (h, dims.nh * d if d and dims.nh else None), "hidden_size, num_attention_heads, head_dim"
        f, key = _ffn(rule, dims)
        return (h, f), f"hidden_size, {key}"
    if rule.split == "replicated" and not bias:
        if ".indexer." in name:  # DeepSeek sparse attention's indexer: index_head_dim / index_n_heads, not derived
            return None
        if tail in ("q_norm.weight", "k_norm.weight"):
            return (d,), "head_dim"
        if tail in ("input_layernorm.weight", "post_attention_layernorm.weight") or (
                rule.scope == "model" and name.endswith("norm.weight")):
            return (h,), "hidden_size"
        if fam.moe is not None and rule.layers == "moe" and not rule.expert and \
                name.endswith(f"{fam.moe.block}.{fam.moe.router}.weight"):
            return (dims.e, h), "num_experts, hidden_size"
    return None


def _ffn(rule: Any, dims: _Dims) -> tuple[int | None, str]:
    if rule.expert:
        return dims.fe, "the expert width: moe_intermediate_size or intermediate_size"
    if rule.layers == "moe":  # the shared expert of an MoE layer
        return dims.fs or None, "shared_expert_intermediate_size"
    return dims.i, "intermediate_size"


def _expand(pattern: str, i: int | None = None, e: int | None = None) -> str:
    """``pattern`` with its layer ``{i}`` / global expert ``{e}`` filled where given."""
    if i is not None:
        pattern = pattern.replace("{i}", str(i))
    return pattern if e is None else pattern.replace("{e}", str(e))


def _fits(actual: list[int], expected: tuple[int | None, ...]) -> bool:
    return len(actual) == len(expected) and all(x is None or a == x for a, x in zip(actual, expected))


def _show(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if x is None else str(x) for x in shape) + "]"


def _layer_rules(rules: tuple, moe_pattern: list[int] | None, linear: list[int] | None, n_layers: int
                 ) -> Iterator[tuple[Any, int]]:
    """(rule, layer) for every layer that has the rule (by the family's MoE/dense and linear/attention patterns;
    a pattern config.json does not give: only the rules of every layer)."""
    for rule in rules:
        if rule.scope != "layer":
            continue
        for i in range(n_layers):
            moe = moe_pattern is not None and i < len(moe_pattern) and bool(moe_pattern[i])
            lin = linear is not None and i < len(linear) and bool(linear[i])
            known = (rule.layers == "all" or moe_pattern is not None) and (rule.mixer == "all" or linear is not None)
            if known and rule.on_layer(moe, lin):
                yield rule, i


def weights_fit_problems(cfg: dict[str, Any], shapes: dict[str, list[int]], where: dict[str, Path], *,
                         lm_head: bool = True) -> list[str]:
    """Sentences (no key, no fix: the caller adds them) for each way the weights ``shapes`` (HF name -> shape,
    from the safetensors headers; ``where``: name -> file) do not fit config.json ``cfg``."""
    from mrl.config.hf import family_of_dict

    out: list[str] = []
    fam = family_of_dict(cfg)
    if fam is None:
        return out
    c = text_config(cfg)
    ns = SimpleNamespace(**c)
    rules = _call(fam.weight_rules_for, ns)
    n_layers = _int(c, "num_hidden_layers")
    if rules is None or n_layers is None:
        return out
    dims = _Dims(c, fam, ns)
    moe_pattern = _call(fam.moe_layers, ns)
    linear = _call(fam.linear_layers, ns)
    tied = bool(c.get("tie_word_embeddings", False))
    # transformers' lm_head rule (also the trainer's, mapping.py): untied needs its own tensor
    head = next((r for r in rules if r.scope == "model" and r.split == "vocab" and "lm_head" in r.hf[0]), None)
    if lm_head and head is not None and not tied and head.hf[0] not in shapes and any(n in shapes for r in rules
                                                                          if r.scope == "model" for n in r.hf):
        out.append(f"config.json says tie_word_embeddings=false but the weights hold no {head.hf[0]} (a tied "
                   "checkpoint?); the trainer would start the output head from the embedding while the engine runs "
                   "another model; fix: set \"tie_word_embeddings\": true in config.json if the model ties them, "
                   f"else re-save the checkpoint with its {head.hf[0]}")
    out += _layer_count(rules, shapes, n_layers, _int(c, "num_nextn_predict_layers") or 0)
    out += _expert_count(rules, shapes, dims, moe_pattern)
    bad: list[str] = []
    if dims.d is None and not dims.mla:
        dims.d = _head_dim_from_q(rules, shapes, dims)
    model_rules = [(r, None) for r in rules if r.scope == "model" and not (r is head and tied)]
    for rule, i in [*model_rules, *_layer_rules(rules, moe_pattern, linear, n_layers)]:
        for e in (range(dims.e or 0) if rule.expert and not rule.fused else (None,)):
            for k, pattern in enumerate(rule.hf):
                name = _expand(pattern, i, e)
                if name not in shapes:
                    continue
                got = _shape(rule, k, name, dims, fam)
                if got is not None and not _fits(shapes[name], got[0]):
                    bad.append(f"{name} {shapes[name]} in {where.get(name, '?')} where config.json ({got[1]}) gives "
                               f"{_show(got[0])}")
    if bad:
        out.append(f"{len(bad)} tensor(s) do not fit: " + "; ".join(bad[:_SHOWN]) + (" ..." if len(bad) > _SHOWN else ""))
    return out


def _head_dim_from_q(rules: tuple, shapes: dict[str, list[int]], dims: _Dims) -> int | None:
    """Without ``head_dim`` in config.json: the query projection's rows over the heads, when they divide."""
    for rule in rules:
        if rule.split in ("qkv", "qkv_gated") and len(rule.hf) == 3:
            per_head = dims.nh * (2 if rule.split == "qkv_gated" else 1) if dims.nh else 0
            q = next((shapes[n] for i in range(len(shapes)) if (n := _expand(rule.hf[0], i)) in shapes), None)
            if q and per_head and q[0] % per_head == 0:
                return q[0] // per_head
    return None


def _indices(prefixes: set[str], shapes: dict[str, list[int]]) -> set[int]:
    """The numbers ``n`` of the tensor names ``<prefix><n>.*`` of the weights (one pass over the names)."""
    if not prefixes:
        return set()
    rx = re.compile("(?:" + "|".join(map(re.escape, sorted(prefixes))) + r")(\d+)\.")
    return {int(m.group(1)) for n in shapes if (m := rx.match(n))}


def _layer_count(rules: tuple, shapes: dict[str, list[int]], n_layers: int, mtp: int) -> list[str]:
    """The decoder layers the weights hold (by the family's per-layer names) against num_hidden_layers."""
    present = _indices({p.split("{i}")[0] for r in rules if r.scope == "layer" for p in r.hf if "{i}" in p}, shapes)
    if not present:
        return []
    top = max(present) + 1
    if top < n_layers or top > n_layers + mtp:
        extra = f" (+ {mtp} multi-token-prediction)" if mtp else ""
        return [(f"config.json says num_hidden_layers={n_layers}{extra} but the weights hold {top} decoder layers "
                f"(0..{top - 1})")]
    return []


def _expert_count(rules: tuple, shapes: dict[str, list[int]], dims: _Dims, moe_pattern: list[int] | None
                  ) -> list[str]:
    """The routed experts of the first MoE layer the weights hold against config.json's count."""
    if dims.e is None or not moe_pattern:
        return []
    rule = next((r for r in rules if r.expert and not r.fused), None)
    if rule is None:
        return []
    for i, moe in enumerate(moe_pattern):
        if moe:
            found = _indices({_expand(p, i).split("{e}")[0] for p in rule.hf if "{e}" in p}, shapes)
            if found and max(found) + 1 != dims.e:
                return [(f"config.json says {dims.e} routed experts but layer {i} of the weights holds "
                        f"{max(found) + 1} ({_expand(rule.hf[0], i, 0)} ...)")]
            if found:
                return []
    return []


def weights_fit_errors(who: str, path: str, cfg: dict[str, Any], headers: dict[Path, dict[str, Any]], *,
                       lm_head: bool = True) -> list[str]:
    """One error line per problem of checkpoint ``path`` (``who``: how the message names it, ``model.path='...'``
    or ``--hf ...``): its config.json ``cfg`` against the parsed safetensors ``headers`` (file -> header), each
    naming the files and the fix. ``lm_head``: the model needs its own output head when untied (a causal LM; not a
    critic or a reward model, whose heads differ)."""
    shapes: dict[str, list[int]] = {}
    where: dict[str, Path] = {}
    for f, header in headers.items():
        for name, info in header.items():
            if name != "__metadata__" and isinstance(info, dict) and isinstance(info.get("shape"), list):
                shapes[name], where[name] = info["shape"], f
    files = ", ".join(str(f) for f in list(headers)[:2]) + (" ..." if len(headers) > 2 else "")
    conf = Path(path) / "config.json"
    return [f"{who}: the weights do not fit config.json ({describe(cfg)}; {conf} against {files}): {p}; {WEIGHTS_FIX}"
            for p in weights_fit_problems(cfg, shapes, where, lm_head=lm_head)]
