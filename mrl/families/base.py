"""What a model family declares (:class:`Family`, :class:`MoE`) and the generic rules that turn those
declarations into Megatron settings. No torch or Megatron here: ``mrl plan`` and the rollout engine
read the same objects the trainer builds from.

A family module (``mrl/families/<name>.py``) defines one ``FAMILY = Family(...)`` holding, side by side:

* ``name`` (the family key, which is also the HF ``model_type``) and the HF ``architectures`` it owns;
* the config facts: ``qkv_bias`` (Megatron ``add_qkv_bias``; ``attention_bias=true`` is refused without
  it), ``qk_norm`` (per-head q/k RMSNorm: ``qk_layernorm`` in the config and the layer spec),
  ``sliding_window`` (a set ``sliding_window`` windows every layer: Megatron ``window_size=(W-1, 0)``),
  ``moe`` (an :class:`MoE`: router, experts, shared expert, and which layers are MoE: ``layers`` gives
  1/0 per decoder layer, Megatron's ``moe_layer_freq`` list when some are dense, whose MLP the family's
  ``layers="dense"`` weight rules map);
* ``qkv_bias_key`` / ``qk_norm_key``: the config.json key that switches the qkv bias / q/k norm per
  checkpoint (GLM-4.5: ``attention_bias``, ``use_qk_norm``); None: the family always has what it declares.
  :meth:`Family.weight_rules_for` drops the rules of a switched-off piece;
* ``weight_rules``: its HF ↔ Megatron table (:mod:`mrl.families.rules`, applied by
  :mod:`mrl.megatron.mapping`);
* ``mla``: multi-latent attention (DeepSeek-V3): config.json -> ``MLATransformerConfig`` keywords;
* ``plan_notes``: lines ``mrl plan`` prints for a checkpoint of the family (what it skips or freezes);
* ``engine_refuses_sliding_window``: the embedded engine's fast decode path hands a config with
  ``sliding_window`` set to transformers' forward (:mod:`mrl.rollout.engine.decode`); ``attention_sinks`` too;
* ``refuse``: its own refusals, run after the common decoder checks of the provider;
* ``config_kwargs``: any further ``TransformerConfig`` keywords of the family (gpt-oss: biases on every linear,
  attention sinks, per-layer windows, the clamped SwiGLU), applied after the ones above;
* ``linear_attention``: a hybrid decoder's Gated DeltaNet layers (a :class:`LinearAttention`: which layers, their
  widths; Qwen3.5, Qwen3-Next), built as :class:`mrl.megatron.gated_delta_net.GatedDeltaNet` in place of attention;
* ``attention_output_gate``: the full-attention layers gate their output per head, ``o · sigmoid(g)`` with ``g``
  a second half of ``q_proj`` (Megatron ``attention_output_gate``);
* ``zero_centered_norm``: every RMSNorm of the decoder stores ``γ − 1`` (``x̂ · (1 + w)``; Megatron's
  ``layernorm_zero_centered_gamma``, built by mrl as :class:`mrl.megatron.gated_delta_net.ZeroCenteredRMSNorm`);
* ``dsa``: DeepSeek sparse attention on top of ``mla`` (DeepSeek-V3.2, GLM-5): the lightning indexer's sizes, its
  top-k and RoPE layout (:mod:`mrl.megatron.dsa`);
* ``wrapped``: the HF prefixes a vision-language checkpoint of the family keeps beside the decoder and mrl carries
  untouched (the vision tower ``model.visual.``; multi-token-prediction ``mtp.``); its decoder is read through
  :func:`mrl.families.views.decoder_config`. An architecture in ``architectures`` whose config has no
  ``text_config`` (``Qwen3_5ForCausalLM``) is the plain decoder;
* ``vision``: a vision-language family whose vision tower mrl builds and trains (a :class:`VisionTower`: the
  transformers class that builds it, its HF prefix, the multimodal-RoPE kind, deepstack), run on the first pipeline
  stage by :mod:`mrl.megatron.vision`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mrl.families.rules import QK_NORM, QKV_BIAS, Rule
from mrl.families.views import decoder_prefix


def _zero(_hf_config: Any) -> int:
    return 0


def _accept(_hf_config: Any) -> None:
    return None


def _no_kwargs(_hf_config: Any) -> dict[str, Any]:
    return {}


def num_experts(hf_config: Any) -> int:
    n = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not n:
        raise ValueError("config.json of an MoE model has no num_experts / num_local_experts")
    return int(n)


def router_topk(hf_config: Any) -> int:
    return int(hf_config.num_experts_per_tok)


def all_moe_layers(hf_config: Any) -> list[int]:
    """Every decoder layer an MoE layer (Mixtral)."""
    return [1] * int(hf_config.num_hidden_layers)


def qwen_moe_layers(hf_config: Any) -> list[int]:
    """Qwen2-MoE / Qwen3-MoE (transformers' ``*DecoderLayer``): layer ``i`` is an MoE layer iff
    ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``; the others are dense SwiGLU MLPs
    of ``intermediate_size`` (``model.layers.{i}.mlp.{gate,up,down}_proj``, no shared expert)."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    if step < 1:
        raise ValueError(f"config.json decoder_sparse_step={step} must be >= 1")
    dense = {int(i) for i in (getattr(hf_config, "mlp_only_layers", None) or [])}
    return [int(i not in dense and (i + 1) % step == 0) for i in range(int(hf_config.num_hidden_layers))]


def _none(_hf_config: Any) -> None:
    return None


def _no_notes(_hf_config: Any) -> list[str]:
    return []


# transformers' group-limited routers (DeepSeek-V3, GLM-4.5) score a group by the sum of its top-2 expert
# scores; Megatron's ``group_limited_topk`` sums the top-(topk // group_topk). They agree iff that is 2.
HF_GROUP_SCORE_TOPK = 2

IntFromConfig = int | None | Callable[[Any], int | None]


def _resolve(value: IntFromConfig, hf_config: Any) -> int | None:
    v = value(hf_config) if callable(value) else value
    return None if v is None else int(v)


@dataclass(frozen=True)
class MoE:
    """A routed-experts family: the HF checkpoint layout of its MoE block and its router settings.

    Router (one token, ``E`` experts, top-``k``; ``b`` the score-correction bias when ``expert_bias``)::

        softmax:  p = softmax(l);  S = topk(p, k);  w_e = p_e / sum_S p  (norm_topk) or p_e
        sigmoid:  s = sigmoid(l);  S = topk(s + b, k) [inside the top group_topk of num_groups groups];
                  w_e = s_e / sum_S s  (Megatron always renormalises when k > 1: norm_topk must be true)
        w_e *= topk_scaling  (when set: DeepSeek's routed_scaling_factor)
    """

    block: str                              # HF module of the MoE block: model.layers.{i}.<block>
    expert_names: tuple[str, str, str]      # one expert's (gate, up, down) names in the checkpoint
    expert_ffn_size: Callable[[Any], int]   # width of one routed expert's MLP
    norm_topk: Callable[[Any], bool]        # top-k weights renormalised (softmax over the top-k logits)
    shared_expert_size: Callable[[Any], int] = _zero  # 0 = no shared expert
    refuse: Callable[[Any], None] = _accept  # family-specific MoE refusals
    # 1/0 per decoder layer: MoE or dense MLP (of intermediate_size: the family's dense-layer weight rules)
    layers: Callable[[Any], list[int]] = all_moe_layers
    router: str = "gate"                    # HF module of the router: model.layers.{i}.<block>.<router>
    # The checkpoint holds a layer's experts as fused tensors under transformers' own parameter names (gpt-oss):
    # the engine splits nothing (expert_names then only name the fused tensors).
    fused_experts: bool = False
    # ... and those fused tensors are in ``x @ W`` layout, the transposes of transformers' modules (Qwen3-VL-MoE's
    # ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``): the engine names its modules' tensors by transposed views
    fused_experts_xw: bool = False
    # Experts with biases (gpt-oss): Megatron supports them only with expert_tensor_parallel_size=1.
    expert_linear_bias: bool = False
    # "softmax" | "sigmoid" (Megatron moe_router_score_function)
    score_function: str = "softmax"
    # a per-expert score-correction bias added for the choice only (HF e_score_correction_bias; Megatron
    # moe_router_enable_expert_bias, kept frozen in RL: moe_router_bias_update_rate=0, docs/moe.md)
    expert_bias: bool = False
    # group-limited top-k: num_groups groups of E/num_groups experts, the token picks among group_topk of them
    num_groups: IntFromConfig = None
    group_topk: IntFromConfig = None
    # a factor on the routed weights (Megatron moe_router_topk_scaling_factor), None = 1
    topk_scaling: Callable[[Any], float | None] = _none
    # the shared expert's output through sigmoid(g·x) (Qwen2-MoE) or added as is (DeepSeek-V3, GLM-4.5)
    shared_expert_gate: bool = True

    def router_groups(self, hf_config: Any) -> tuple[int | None, int | None]:
        """Megatron's (moe_router_num_groups, moe_router_group_topk), (None, None) when the group choice
        selects every group (one group, or group_topk >= num_groups: no restriction)."""
        groups, gtopk = _resolve(self.num_groups, hf_config), _resolve(self.group_topk, hf_config)
        if not groups or groups <= 1 or not gtopk or gtopk >= groups:
            return None, None
        return groups, gtopk

    def _check_router(self, hf_config: Any) -> None:
        e, k = num_experts(hf_config), router_topk(hf_config)
        if self.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE score_function {self.score_function!r}: expected softmax or sigmoid")
        if self.expert_bias and self.score_function != "sigmoid":
            raise ValueError("an MoE expert bias needs the sigmoid score function (Megatron's rule)")
        if self.score_function == "sigmoid" and not self.norm_topk(hf_config):
            # Megatron's sigmoid router divides the top-k scores by their sum whenever k > 1 (and never when k = 1)
            raise ValueError(
                "config.json norm_topk_prob=false with a sigmoid router: Megatron always renormalises the "
                "top-k sigmoid scores, so it would compute a different model; convert the checkpoint with "
                "norm_topk_prob=true only if it was trained that way, else this model is not supported")
        if self.score_function == "sigmoid" and k == 1:
            raise ValueError(
                "config.json num_experts_per_tok=1 with a sigmoid router and norm_topk_prob=true: transformers "
                "renormalises the single weight to 1, Megatron keeps sigmoid(l); not supported")
        raw_groups = _resolve(self.num_groups, hf_config)
        if raw_groups and e % raw_groups:
            raise ValueError(f"config.json n_group={raw_groups} does not divide the {e} routed experts")
        groups, gtopk = self.router_groups(hf_config)
        if groups is not None:
            if k % gtopk or k // gtopk != HF_GROUP_SCORE_TOPK:
                raise ValueError(
                    f"config.json group-limited routing n_group={groups}, topk_group={gtopk}, "
                    f"num_experts_per_tok={k}: transformers scores a group by the sum of its top-"
                    f"{HF_GROUP_SCORE_TOPK} experts, Megatron by the sum of its top-(num_experts_per_tok // "
                    f"topk_group) = top-{k // gtopk}; they choose different experts. Supported when "
                    f"num_experts_per_tok = {HF_GROUP_SCORE_TOPK} * topk_group, or n_group=1 / topk_group >= n_group")
            if k > gtopk * (e // groups):
                raise ValueError(f"config.json num_experts_per_tok={k} exceeds the {gtopk * (e // groups)} experts "
                                 f"of topk_group={gtopk} groups")

    def layer_pattern(self, hf_config: Any) -> list[int] | None:
        """Megatron's ``moe_layer_freq`` list when some layers are dense, None when every layer is MoE."""
        pattern = self.layers(hf_config)
        if len(pattern) != int(hf_config.num_hidden_layers) or set(pattern) - {0, 1}:
            raise ValueError(f"MoE layer pattern {pattern}: expected one 0/1 per decoder layer")
        if not any(pattern):
            raise ValueError(
                "config.json makes every layer dense (decoder_sparse_step / mlp_only_layers / first dense layers "
                "cover all num_hidden_layers): an MoE architecture without an MoE layer is not supported; "
                "convert it to its dense family's architecture")
        return pattern if 0 in pattern else None

    def check(self, hf_config: Any) -> None:
        """Refuse what Megatron's local MoE layer would compute differently from transformers."""
        e, k = num_experts(hf_config), router_topk(hf_config)
        if not 1 <= k <= e:
            raise ValueError(f"config.json num_experts_per_tok={k} must be in [1, num_experts={e}]")
        self._check_router(hf_config)
        self.refuse(hf_config)
        self.layer_pattern(hf_config)

    def transformer_kwargs(self, hf_config: Any, *, ep: int, etp: int) -> dict[str, Any]:
        """``TransformerConfig`` keywords of the MoE layer (dropless, no grouped GEMM on the local spec;
        callers may override the dispatcher, the aux-loss coefficient and replay)."""
        e = num_experts(hf_config)
        if e % ep:
            raise ValueError(f"num_experts={e} is not divisible by expert_model_parallel_size={ep}")
        if self.expert_linear_bias and etp != 1:
            raise ValueError(f"expert_tensor_parallel_size={etp}: this model's experts have biases, which Megatron "
                             "supports only with expert_tensor_parallel_size=1; fix: set it to 1")
        kw: dict[str, Any] = {
            "num_moe_experts": e,
            "moe_ffn_hidden_size": self.expert_ffn_size(hf_config),
            "moe_router_topk": router_topk(hf_config),
            # norm_topk: softmax over the top-k logits == renormalised full softmax; else softmax first.
            "moe_router_pre_softmax": self.score_function == "softmax" and not self.norm_topk(hf_config),
            "moe_router_score_function": self.score_function,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": False,
            "moe_permute_fusion": False,
            "moe_router_fusion": False,
            "moe_expert_capacity_factor": None,  # dropless, as transformers and SGLang
            "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": etp,
        }
        if self.expert_bias:
            kw["moe_router_enable_expert_bias"] = True
            # the bias is a checkpoint weight RL keeps frozen (docs/moe.md): no aux-loss-free update
            kw["moe_router_bias_update_rate"] = 0.0
        groups, gtopk = self.router_groups(hf_config)
        if groups is not None:
            kw["moe_router_num_groups"], kw["moe_router_group_topk"] = groups, gtopk
        scaling = self.topk_scaling(hf_config)
        if scaling is not None and float(scaling) != 1.0:
            kw["moe_router_topk_scaling_factor"] = float(scaling)
        pattern = self.layer_pattern(hf_config)
        if pattern is not None:  # mixed dense/MoE: dense layers are SwiGLU MLPs of ffn_hidden_size
            kw["moe_layer_freq"] = pattern
        shared = self.shared_expert_size(hf_config)
        if shared:
            kw["moe_shared_expert_intermediate_size"] = shared
            kw["moe_shared_expert_gate"] = self.shared_expert_gate
            kw["moe_shared_expert_overlap"] = False
        return kw


def layer_types_pattern(hf_config: Any) -> list[int]:
    """1 per linear-attention layer, 0 per full-attention layer, from config.json ``layer_types``
    (``"linear_attention"`` / ``"full_attention"``) or, without it, ``full_attention_interval`` (every k-th layer
    full: transformers' default for Qwen3-Next / Qwen3.5 configs)."""
    n = int(hf_config.num_hidden_layers)
    types = getattr(hf_config, "layer_types", None)
    if types:
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown or len(types) != n:
            raise ValueError(f"config.json layer_types={list(types)}: expected num_hidden_layers={n} entries of "
                             "'linear_attention' / 'full_attention'")
        return [int(t == "linear_attention") for t in types]
    k = int(getattr(hf_config, "full_attention_interval", 0) or 0)
    if k < 1:
        raise ValueError("config.json of a hybrid-attention model has neither layer_types nor full_attention_interval")
    return [int((i + 1) % k != 0) for i in range(n)]


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet layers of a hybrid decoder (the math: :mod:`mrl.megatron.gated_delta_net`): ``layers`` gives
    1 per linear-attention layer; their widths are config.json's ``linear_num_key_heads`` / ``linear_num_value_heads``
    (heads) and ``linear_key_head_dim`` / ``linear_value_head_dim``, the conv kernel ``linear_conv_kernel_dim``."""

    layers: Callable[[Any], list[int]] = layer_types_pattern

    def pattern(self, hf_config: Any) -> list[int]:
        pattern = self.layers(hf_config)
        if len(pattern) != int(hf_config.num_hidden_layers) or set(pattern) - {0, 1}:
            raise ValueError(f"linear-attention layer pattern {pattern}: expected one 0/1 per decoder layer")
        return pattern

    def check(self, hf_config: Any) -> None:
        self.pattern(hf_config)
        nk, nv = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
        if nv % nk:
            raise ValueError(f"config.json linear_num_value_heads={nv} is not a multiple of linear_num_key_heads={nk}")
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json hidden_act={act!r}: the Gated DeltaNet conv runs silu only")

    def transformer_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """Megatron's ``linear_*`` fields (read by :class:`mrl.megatron.gated_delta_net.GatedDeltaNet`);
        ``linear_attention_freq`` as the 1/0 list marks the layers non-homogeneous for Megatron's distributed
        checkpoint (each layer's tensors under its own key; ``experimental_attention_variant`` stays unset: mrl
        builds the layers, not Megatron's spec)."""
        return {"linear_attention_freq": self.pattern(hf_config),"linear_num_key_heads": int(hf_config.linear_num_key_heads),
                "linear_num_value_heads": int(hf_config.linear_num_value_heads),
                "linear_key_head_dim": int(hf_config.linear_key_head_dim),
                "linear_value_head_dim": int(hf_config.linear_value_head_dim),
                "linear_conv_kernel_dim": int(hf_config.linear_conv_kernel_dim)}


@dataclass(frozen=True)
class VisionTower:
    """A vision-language family's vision tower and multimodal RoPE (Qwen2.5-VL, Qwen3-VL).

    The tower is transformers' own module ``transformers.models.<module>.<model_class>`` built from config.json's
    ``vision_config`` (``<config_class>``), replicated over TP on the first pipeline stage; its output rows replace
    the embeddings of the ``image_token_id`` tokens in order. Its tensors are the checkpoint's ``<prefix>*``.

    Multimodal RoPE (``mrope``): each token has a position per axis (t, h, w) and the rotary half-dimension's
    frequency ``j`` rotates by the position of axis ``a(j)``: ``"sections"`` (Qwen2-VL / Qwen2.5-VL):
    ``a(j) = 0`` for the first ``mrope_section[0]`` frequencies, 1 for the next ``mrope_section[1]``, 2 for the
    rest; ``"interleaved"`` (Qwen3-VL): ``a(j) = j mod 3`` for ``j < 3·mrope_section[k]`` of axis k, else 0.
    ``deepstack``: the tower also returns features of some of its blocks, added to the image tokens' hidden
    states after the first decoder layers (Qwen3-VL)."""

    module: str                 # transformers.models.<module>
    model_class: str            # the tower's class in modeling_<module>
    config_class: str           # its config class in configuration_<module>
    prefix: str = "model.visual."
    # where the checkpoint keeps the decoder's ``model.*`` tensors: transformers saves Qwen2.5-VL in its released
    # layout (``model.layers.*``, ``visual.*``), Qwen3-VL under ``model.language_model.*`` / ``model.visual.*``
    decoder_prefix: str = "model.language_model."
    mrope: str = "sections"     # "sections" | "interleaved"
    deepstack: bool = False
    # ``mrope_section`` when config.json's rope_parameters has none (transformers' default for the family: Qwen3.5's
    # text config omits it and its rotary embedding falls back to [11, 11, 10]); None: config.json must give it
    mrope_default: tuple[int, int, int] | None = None
    # the tower's parameter count from config.json's ``vision_config`` (``mrl plan``'s memory estimate, torch-free)
    param_count: Callable[[dict], int] | None = None


def vision_plan_notes(hf_config: Any) -> list[str]:
    """What ``mrl plan`` says about a vision-language checkpoint whose tower mrl builds (``Family.plan_notes`` of the
    Qwen2.5-VL / Qwen3-VL families): where the tower runs and the freeze switch."""
    vcfg = getattr(hf_config, "mrl_vision_config", None) or {}
    deep = len(vcfg.get("deepstack_visual_indexes") or [])
    notes = [(f"vision tower ({vcfg.get('depth', '?')} blocks, transformers' own module) on the first pipeline stage, "
             "replicated over TP, its features at the image tokens; frozen (out of the optimizer) unless "
             "actor.freeze_vision_tower=false")]
    if deep:
        notes.append(f"deepstack: image features added after decoder layers 0..{deep - 1} (on the first stage)")
    return notes


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring for what each field declares)."""

    name: str
    architectures: tuple[str, ...]
    weight_rules: tuple[Rule, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    qkv_bias_key: str | None = None
    qk_norm_key: str | None = None
    sliding_window: bool = False
    moe: MoE | None = None
    engine_refuses_sliding_window: bool = False
    # per-head attention sinks (gpt-oss): the engine's fast decode path has none, transformers' forward runs it
    attention_sinks: bool = False
    refuse: Callable[[Any], None] = _accept
    config_kwargs: Callable[[Any], dict[str, Any]] = _no_kwargs
    # multi-latent attention (DeepSeek-V3): config.json -> MLATransformerConfig keywords; None = GQA attention
    mla: Callable[[Any], dict[str, Any]] | None = None
    # lines ``mrl plan`` prints for this checkpoint (what the family does that a user should know)
    plan_notes: Callable[[Any], list[str]] = _no_notes
    # hybrid decoders (Qwen3.5, Qwen3-Next): the Gated DeltaNet layers; None = attention in every layer
    linear_attention: LinearAttention | None = None
    attention_output_gate: bool = False
    zero_centered_norm: bool = False
    # HF prefixes of a vision-language checkpoint that are not the decoder, carried untouched on export
    wrapped: tuple[str, ...] = ()
    # a vision-language family whose vision tower mrl builds (run on the first pipeline stage); None = text only
    vision: VisionTower | None = None
    # DeepSeek sparse attention (DeepSeek-V3.2, GLM-5; needs ``mla``): config.json -> the lightning indexer's
    # ``n_heads``, ``head_dim``, ``topk`` and ``rope_interleaved`` (:mod:`mrl.megatron.dsa`); None = dense attention
    dsa: Callable[[Any], dict[str, Any]] | None = None

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    def has_qkv_bias(self, hf_config: Any) -> bool:
        """This checkpoint's attention has a q/k/v bias (the family's, switched by ``qkv_bias_key``)."""
        return self.qkv_bias and (self.qkv_bias_key is None or bool(getattr(hf_config, self.qkv_bias_key, False)))

    def has_qk_norm(self, hf_config: Any) -> bool:
        """This checkpoint's attention has per-head q/k RMSNorms (the family's, switched by ``qk_norm_key``)."""
        return self.qk_norm and (self.qk_norm_key is None or bool(getattr(hf_config, self.qk_norm_key, False)))

    @property
    def is_hybrid(self) -> bool:
        return self.linear_attention is not None

    def weight_rules_for(self, hf_config: Any) -> tuple[Rule, ...]:
        """The weight rules of this checkpoint: those whose ``Rule.when`` config.json does not meet and those of a
        qkv bias / q/k norm it switches off are dropped (the layer has no such parameter); a vision-language
        checkpoint's view (:func:`mrl.families.views.decoder_config`) names the decoder's tensors under its prefix."""
        off: set[Rule] = set()
        if not self.has_qkv_bias(hf_config):
            off.update(QKV_BIAS)
        if not self.has_qk_norm(hf_config):
            off.update(QK_NORM)
        rules = tuple(r for r in self.weight_rules if r not in off and r.applies(hf_config))
        prefix = decoder_prefix(hf_config)
        return tuple(r.with_hf_prefix(prefix) for r in rules) if prefix else rules

    def linear_layers(self, hf_config: Any) -> list[int]:
        """1/0 per decoder layer: a Gated DeltaNet layer or an attention layer (all 0 without linear attention)."""
        n = int(hf_config.num_hidden_layers)
        return self.linear_attention.pattern(hf_config) if self.linear_attention else [0] * n

    def check(self, hf_config: Any) -> None:
        """The family's own refusals (the MoE checks included); the provider runs the common ones first."""
        self.refuse(hf_config)
        if self.moe is not None:
            self.moe.check(hf_config)
        if self.linear_attention is not None:
            self.linear_attention.check(hf_config)

    def transformer_kwargs(self, hf_config: Any, *, ep: int = 1, etp: int = 1) -> dict[str, Any]:
        """The family's ``TransformerConfig`` keywords (the provider adds the common decoder ones)."""
        kw: dict[str, Any] = {"add_qkv_bias": self.has_qkv_bias(hf_config), "qk_layernorm": self.has_qk_norm(hf_config)}
        window = getattr(hf_config, "sliding_window", None) if self.sliding_window else None
        if window:
            # transformers: key k is seen by query q iff q - W < k <= q; Megatron's (left, right) = (W - 1, 0)
            kw["window_size"] = (int(window) - 1, 0)
        if self.mla is not None:
            kw.update(self.mla(hf_config))
        if self.moe is not None:
            kw.update(self.moe.transformer_kwargs(hf_config, ep=ep, etp=etp))
        if self.dsa is not None:  # Megatron's MLA then hands x and its query latent to the core attention
            d = self.dsa(hf_config)
            kw.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=d["n_heads"],
                      dsa_indexer_head_dim=d["head_dim"], dsa_indexer_topk=d["topk"], dsa_indexer_loss_coeff=0.0)
        if self.attention_output_gate:
            kw["attention_output_gate"] = True
        if self.linear_attention is not None:
            kw.update(self.linear_attention.transformer_kwargs(hf_config))
        kw.update(self.config_kwargs(hf_config))
        return kw

    def layer_spec_kwargs(self, hf_config: Any) -> dict[str, Any]:
        """What Megatron's layer-spec builders need: ``qk_layernorm``, ``num_experts`` (None = dense),
        ``moe_layers`` (1/0 per global layer when an MoE model mixes in dense layers, else None),
        ``multi_latent_attention``, ``linear_layers`` (1/0 per global layer of a hybrid decoder, else None) and
        ``zero_centered_norm``."""
        return {"qk_layernorm": self.has_qk_norm(hf_config), "num_experts": num_experts(hf_config) if self.moe else None,
                "moe_layers": self.moe.layer_pattern(hf_config) if self.moe else None,
                "multi_latent_attention": self.is_mla,
                "linear_layers": self.linear_layers(hf_config) if self.linear_attention else None,
                "zero_centered_norm": self.zero_centered_norm}

    def moe_layers(self, hf_config: Any) -> list[int]:
        """1/0 per decoder layer: an MoE layer or a dense MLP (all 0 for a dense family)."""
        n = int(hf_config.num_hidden_layers)
        return (self.moe.layer_pattern(hf_config) or [1] * n) if self.moe else [0] * n
