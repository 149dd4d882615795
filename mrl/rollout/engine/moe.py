"""Mixture-of-experts models in the engine: checkpoint names of fused experts, and the routed-experts capture.

**Names.** Weights reach the engine under the Hugging Face *checkpoint* names, one tensor per expert, as
safetensors files hold them and as SGLang's loaders expect them::

    Qwen3-MoE / Qwen2-MoE: model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight
    GLM-4.5:               model.layers.{i}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight
    Mixtral:               model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight
                           model.layers.{i}.block_sparse_moe.gate.weight

transformers 5 holds a layer's experts fused (its ``conversion_mapping``: ``MergeModulelist(dim=0)`` then
``Concatenate(dim=1)``)::

    mlp.experts.gate_up_proj [E, 2I, H]:  gate_up_proj[e, :I] = gate_proj_e (w1),  gate_up_proj[e, I:] = up_proj_e (w3)
    mlp.experts.down_proj    [E, H, I]:   down_proj[e] = down_proj_e (w2)

and Mixtral's ``block_sparse_moe`` is its ``mlp``. :func:`checkpoint_views` gives every parameter under its
checkpoint name(s) as a *view* of the fused parameter, so a weight update copies each expert straight into its
slice and ``/weights_checksum`` / ``/get_weights_by_name`` answer per checkpoint name (the inverse map).
gpt-oss checkpoints hold the experts fused as transformers does (``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` with
gate/up interleaved, ``down_proj``, their biases; router ``mlp.router``): its names are the parameters' own
(``MoE.fused_experts``). Qwen3-VL-MoE checkpoints hold them fused in ``x @ W`` layout (``gate_up_proj [E, H, 2I]``
= ``[gate | up]``, ``down_proj [E, I, H]``), the transposes of transformers' modules: named by transposed views
(``MoE.fused_experts_xw``).

Hybrid MoE checkpoints (Qwen3.5 / Qwen3.6 MoE, whose vision-language form nests the decoder under
``model.language_model.``, and Qwen3-Next) name their experts as Qwen3-MoE does, beside a gated shared expert
(``mlp.shared_expert.{gate,up,down}_proj``, ``mlp.shared_expert_gate``: parameters under their own names); their
text-only configs' ``model_type`` (``qwen3_5_moe_text``) is looked up by its family key
(:func:`mrl.families.family_key`).

Persistent buffers a checkpoint holds (DeepSeek-V3's and GLM-4.5's ``mlp.gate.e_score_correction_bias``) are named
too.

**Routed experts.** :class:`RoutingCapture` hooks every layer's top-k router (``*TopKRouter`` /
``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter`` at ``mlp.<MoE.router>``: ``gate``, gpt-oss ``router``; its forward
returns ``(router_logits, router_scores, router_indices)``) and keeps the ``router_indices`` the experts
then consumed, in prefill and decode alike. A layer without a router (Qwen2-MoE's ``mlp_only_layers``) keeps
0s, as SGLang's capture buffer does (it is sized for every hidden layer and zero-initialised).
"""
from __future__ import annotations

import re

import torch

from mrl.families import FAMILIES, family_key

#: ``model_type`` -> (checkpoint module of the MoE block, names of (gate, up, down) per expert), as each MoE
#: family declares them (``MoE.block``/``MoE.expert_names`` in mrl/families/<name>.py)
EXPERT_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    name: (fam.moe.block, fam.moe.expert_names) for name, fam in FAMILIES.items() if fam.moe is not None
}
#: ``model_type`` -> the router's module name under ``mlp`` (``MoE.router``)
ROUTER_NAMES: dict[str, str] = {name: fam.moe.router for name, fam in FAMILIES.items() if fam.moe is not None}
#: the families whose checkpoints hold fused experts under the parameters' own names (nothing to map)
FUSED_CHECKPOINTS = frozenset(name for name, fam in FAMILIES.items() if fam.moe is not None and fam.moe.fused_experts)
_FUSED = re.compile(r"^(?P<pre>.*\.layers\.\d+\.)mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<pre>.*\.layers\.\d+\.)mlp\.gate\.weight$")


def is_moe(config) -> bool:
    """A config of a family whose experts the engine maps (:data:`EXPERT_NAMES`)."""
    return family_key(getattr(config, "model_type", None)) in EXPERT_NAMES


def _vision_checkpoint_name(name: str, vision) -> str:
    """transformers' module name of a vision-language model's tensor -> its checkpoint name: the decoder's
    ``model.language_model.`` and the tower's ``model.visual.`` under the family's ``VisionTower`` prefixes."""
    for module, saved in (("model.language_model.", vision.decoder_prefix), ("model.visual.", vision.prefix)):
        if name.startswith(module):
            return saved + name[len(module):]
    return name


def checkpoint_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter under its checkpoint name(s) (tied ones under each name); a fused expert parameter as
    one view per expert and projection (see the module docstring). Built on each call: after
    ``ModelRunner.release``/``resume`` the parameters hold new storage, and old views would write nowhere."""
    mt = family_key(getattr(model.config, "model_type", None))
    named = dict(model.named_parameters(remove_duplicate=False))
    persistent = model.state_dict(keep_vars=True)
    # checkpoint buffers (DeepSeek-V3's router e_score_correction_bias): the trainer sends them with the weights
    named.update({n: b for n, b in model.named_buffers() if n in persistent})
    vision = FAMILIES[mt].vision if mt in FAMILIES else None
    if vision is not None:  # the checkpoint's (and the trainer's) names: Qwen2.5-VL's released model.* / visual.*
        named = {_vision_checkpoint_name(n, vision): p for n, p in named.items()}
    if mt in FUSED_CHECKPOINTS and FAMILIES[mt].moe.fused_experts_xw:
        return {n: p.transpose(1, 2) if _FUSED.match(n) else p for n, p in named.items()}
    if mt not in EXPERT_NAMES or mt in FUSED_CHECKPOINTS:
        return named
    block, (gate, up, down) = EXPERT_NAMES[mt]
    out: dict[str, torch.Tensor] = {}
    for name, p in named.items():
        m = _FUSED.match(name)
        if m is None:
            r = _ROUTER.match(name)
            out[f"{r['pre']}{block}.gate.weight" if r else name] = p
            continue
        pre = f"{m['pre']}{block}.experts."
        if m["kind"] == "gate_up_proj":
            inter = p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{pre}{e}.{gate}.weight"] = p[e, :inter]
                out[f"{pre}{e}.{up}.weight"] = p[e, inter:]
        else:
            for e in range(p.shape[0]):
                out[f"{pre}{e}.{down}.weight"] = p[e]
    return out


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers: ``model.model.language_model.layers`` of a vision-language model (its decoder nested
    beside the vision tower), ``model.model.layers`` otherwise."""
    inner = model.model
    return inner.language_model.layers if hasattr(inner, "language_model") else inner.layers


class RoutingCapture:
    """Top-k expert ids of every layer for the tokens of one forward, from the routers' own outputs.

    ``armed`` False (the default) makes the hooks no-ops: only forwards of a step with a request that asked
    for routed experts pay the copy. The caller holds the scheduler's model lock around ``arm`` ...
    ``take``, as around every forward, so two forwards never mix."""

    def __init__(self, model: torch.nn.Module) -> None:
        text = model.config.get_text_config()
        self.num_layers = int(text.num_hidden_layers)
        self.top_k = int(text.num_experts_per_tok)
        self.armed = False
        self._ids: dict[int, torch.Tensor] = {}
        self.layers: list[int] = []
        router_name = ROUTER_NAMES.get(family_key(text.model_type), "gate")
        for i, layer in enumerate(decoder_layers(model)):
            router = getattr(getattr(layer, "mlp", None), router_name, None)
            # *TopKRouter (Qwen, Mixtral, gpt-oss), DeepseekV3TopkRouter, Glm4MoeTopkRouter: forward -> (logits,
            # weights, indices)
            if router is None or not type(router).__name__.lower().endswith("topkrouter"):
                continue  # a dense layer (Qwen2-MoE mlp_only_layers / decoder_sparse_step)
            router.register_forward_hook(self._hook(i))
            self.layers.append(i)
        if not self.layers:
            raise ValueError(f"model_type {text.model_type!r}: no top-k router module found to capture routed experts")

    def _hook(self, layer: int):
        def hook(_mod, _inp, out) -> None:
            if self.armed:
                self._ids[layer] = out[2]  # router_indices [tokens, top_k]: what the experts consumed
        return hook

    def arm(self) -> None:
        self._ids.clear()
        self.armed = True

    def take(self, num_tokens: int) -> torch.Tensor:
        """int32 ``[num_tokens, num_layers, top_k]`` of the forward since :meth:`arm` (rows in the order the
        model flattened its input: batch-major, then position); disarms."""
        self.armed = False
        out = torch.zeros(num_tokens, self.num_layers, self.top_k, dtype=torch.int32)
        for layer, ids in self._ids.items():
            if ids.shape != (num_tokens, self.top_k):
                raise RuntimeError(f"layer {layer}: router gave ids of shape {list(ids.shape)} for {num_tokens} tokens")
            out[:, layer] = ids.to(device="cpu", dtype=torch.int32)
        self._ids.clear()
        return out
