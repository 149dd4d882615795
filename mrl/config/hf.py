"""Model facts read from a Hugging Face ``config.json`` with plain json (no transformers import).

Used for up-front checks (heads vs TP, layers vs PP, positions) and the plan's memory estimate.
Parameter count of a decoder-only Llama/Qwen/Mistral-style model with hidden h, layers L,
heads n_h, KV heads n_kv, head dim d, MLP width I, vocab V (gated MLP, RMSNorm):

    per layer  = h*n_h*d + 2*h*n_kv*d + n_h*d*h   (q, k, v, o)  [+ n_h*d + 2*n_kv*d if qkv bias]
               + 3*h*I                             (gate, up, down; MoE: E experts of 3*h*I_moe + router h*E)
               + 2*h                               (input / post-attention norms) [+ 2*d if q/k norm]
    total      = V*h (embedding) + L*per_layer + h (final norm) + V*h (lm head, unless tied)

Multi-latent attention (DeepSeek-V3) replaces q, k, v by its latent projections (:meth:`ModelShape._attention_params`).
A hybrid decoder (Qwen3.5) has Gated DeltaNet layers (n_k key heads of d_k, n_v value heads of d_v, conv kernel K)::

    linear layer mixer = h*(2*n_k*d_k + 2*n_v*d_v + 2*n_v)   (in_proj: q, k, v, z, b, a)
                       + (2*n_k*d_k + n_v*d_v)*K + 2*n_v + d_v + n_v*d_v*h   (conv1d, A_log, dt_bias, gated norm, out_proj)

and gated full-attention layers whose q_proj is twice as wide (``[q_h | g_h]`` per head). A vision-language
checkpoint is read through its decoder's view (:func:`mrl.families.views.decoder_dict`); the vision tower it carries
is not counted (never trained, not on the trainer).
An MoE model whose config makes some layers dense (Qwen's ``decoder_sparse_step`` / ``mlp_only_layers``,
DeepSeek's ``first_k_dense_replace``)
counts those with the dense 3*h*I MLP in :meth:`ModelShape.param_count`; the plan's per-device estimate
(``layer_params`` per layer) still counts every layer as an MoE layer, an upper bound.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mrl.families import FAMILIES

# model_type -> the family's q/k/v bias (mrl/families/<name>.py); other types: none unless attention_bias
_QKV_BIAS_TYPES = {name for name, fam in FAMILIES.items() if fam.qkv_bias}


@dataclass(frozen=True)
class ModelShape:
    """Architecture numbers needed before any model is built."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    moe_intermediate_size: int = 0
    experts_per_token: int = 0
    shared_expert_size: int = 0
    # MoE layers among num_layers (Qwen's decoder_sparse_step / mlp_only_layers make the others dense MLPs of
    # intermediate_size); None: every layer (or, for a dense model, none)
    moe_layers: int | None = None
    # the shared expert's output through a sigmoid gate (a [h] weight: Qwen2-MoE) or added as is (DeepSeek-V3)
    shared_expert_gate: bool = True
    # multi-latent attention (DeepSeek-V3): (q_lora_rank or 0, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    # v_head_dim); None: GQA attention of num_heads/num_kv_heads x head_dim
    mla: tuple[int, int, int, int, int] | None = None
    # DeepSeek sparse attention on top of MLA (DeepSeek-V3.2, GLM-5): the indexer's (index_n_heads, index_head_dim,
    # index_topk); None: dense attention
    dsa: tuple[int, int, int] | None = None
    # hybrid attention (Qwen3.5): how many layers are Gated DeltaNet layers, and their (n_k, n_v, d_k, d_v, K)
    linear_layers: int = 0
    gdn: tuple[int, int, int, int, int] | None = None
    attention_output_gate: bool = False
    # a vision-language family's tower (Qwen2.5-VL, Qwen3-VL): its parameters, on the first pipeline stage, replicated
    # over TP (0: none, or a tower mrl carries without building it)
    vision_params: int = 0

    @property
    def expert_ffn_size(self) -> int:
        """MLP width of one routed expert (Mixtral keeps it in intermediate_size)."""
        return self.moe_intermediate_size or self.intermediate_size

    def _attention_params(self) -> int:
        h, d, nh = self.hidden_size, self.head_dim, self.num_heads
        if self.mla is not None:
            # q_a_proj + q_a_layernorm + q_b_proj (or q_proj), kv_a_proj_with_mqa + kv_a_layernorm, kv_b_proj, o_proj
            q_lora, kv_lora, nope, rope, v = self.mla
            q = h * q_lora + q_lora + q_lora * nh * (nope + rope) if q_lora else h * nh * (nope + rope)
            mla = q + h * (kv_lora + rope) + kv_lora + kv_lora * nh * (nope + v) + nh * v * h
            if self.dsa is not None:  # the indexer: wq_b, wk, k_norm (weight, bias), weights_proj
                ih, idim, _ = self.dsa
                mla += q_lora * ih * idim + h * idim + 2 * idim + h * ih
            return mla
        attn = h * nh * d * (2 if self.attention_output_gate else 1) + 2 * h * self.num_kv_heads * d + nh * d * h
        if self.qkv_bias:
            attn += nh * d + 2 * self.num_kv_heads * d
        return attn

    def _shared_params(self) -> int:
        """Shared expert (SwiGLU of shared_expert_size) and its gate, on each MoE layer."""
        h = self.hidden_size
        return 3 * h * self.shared_expert_size + (h if self.shared_expert_size and self.shared_expert_gate else 0)

    def _gdn_params(self) -> int:
        nk, nv, dk, dv, k = self.gdn or (0, 0, 0, 0, 0)
        h, conv = self.hidden_size, 2 * nk * dk + nv * dv
        return h * (conv + nv * dv + 2 * nv) + conv * k + 2 * nv + dv + nv * dv * h

    def _mixer_params(self) -> int:
        """Token-mixer params of one layer: attention, or in a hybrid model the larger of its two mixers (the
        per-device estimate counts every layer alike: an upper bound)."""
        attn = self._attention_params()
        return max(attn, self._gdn_params()) if self.linear_layers else attn

    def layer_params(self) -> tuple[int, int]:
        """(dense params, expert params) of one decoder layer; expert params are 0 for dense models."""
        h, d = self.hidden_size, self.head_dim
        attn = self._mixer_params()
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        if self.num_experts:
            experts = self.num_experts * 3 * h * self.expert_ffn_size
            return attn + norms + h * self.num_experts + self._shared_params(), experts
        return attn + norms + 3 * h * self.intermediate_size, 0

    def param_count(self, vocab: int | None = None, *, active: bool = False) -> int:
        """Total parameters (a vision tower's included); ``vocab`` overrides V (Megatron pads it). ``active``: those
        one token uses (an MoE layer runs experts_per_token of its num_experts routed experts)."""
        v = self.vocab_size if vocab is None else vocab
        dense, experts = self.layer_params()
        if active and self.num_experts:
            experts = experts * self.experts_per_token // self.num_experts
        head = 0 if self.tie_word_embeddings else v * self.hidden_size
        layers = self.num_layers * (dense + experts)
        if self.num_experts and self.moe_layers is not None:  # the dense layers: a SwiGLU MLP, no router/experts
            h = self.hidden_size
            dense_mlp = dense - h * self.num_experts - self._shared_params() + 3 * h * self.intermediate_size
            layers = self.moe_layers * (dense + experts) + (self.num_layers - self.moe_layers) * dense_mlp
        if self.linear_layers:  # exact: each layer with its own mixer (the q/k norms only on attention layers)
            layers -= self.num_layers * self._mixer_params()
            layers += (self.num_layers - self.linear_layers) * self._attention_params()
            layers += self.linear_layers * (self._gdn_params() - (2 * self.head_dim if self.qk_norm else 0))
        return v * self.hidden_size + layers + self.hidden_size + head + self.vision_params


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def shape_from_dict(cfg: dict[str, Any]) -> ModelShape:
    """Build a ModelShape from a parsed config.json (a vision-language checkpoint's decoder view); KeyError names a
    missing required key."""
    from mrl.families.views import decoder_dict

    cfg = decoder_dict(cfg)
    model_type = str(cfg.get("model_type", "unknown"))
    fam = family_of_dict(cfg)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return ModelShape(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_get(cfg, "head_dim", default=hidden // heads)),
        intermediate_size=int(_get(cfg, "intermediate_size", default=4 * hidden)),
        max_positions=_get(cfg, "max_position_embeddings"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type in _QKV_BIAS_TYPES)),
        # the family's q/k norm, switched per checkpoint where it says so (GLM-4.5's use_qk_norm)
        qk_norm=fam is not None and fam.has_qk_norm(SimpleNamespace(**cfg)),
        num_experts=int(_get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0)),
        moe_intermediate_size=int(_get(cfg, "moe_intermediate_size", default=0)),
        experts_per_token=int(_get(cfg, "num_experts_per_tok", default=0)),
        shared_expert_size=_shared_expert_size(cfg),
        moe_layers=_moe_layers(cfg),
        shared_expert_gate=fam.moe.shared_expert_gate if fam is not None and fam.moe is not None else True,
        mla=_mla(cfg) if fam is not None and fam.is_mla else None,
        vision_params=_vision_params(cfg, fam),
        dsa=_dsa(cfg, fam),
        **_hybrid(cfg, fam),
    )


def _vision_params(cfg: dict[str, Any], fam: Any) -> int:
    """The vision tower's parameters (its family's count from the view's ``vision_config``), 0 without one."""
    from mrl.families.views import VISION

    tower = fam.vision if fam is not None else None
    if tower is None or tower.param_count is None or not isinstance(cfg.get(VISION), dict):
        return 0
    return int(tower.param_count(cfg[VISION]))


def _hybrid(cfg: dict[str, Any], fam: Any) -> dict[str, Any]:
    """The hybrid-attention fields of ModelShape (none for a family without linear attention)."""
    if fam is None or fam.linear_attention is None:
        return {}
    ns = SimpleNamespace(**cfg)
    gdn = (int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"]), int(cfg["linear_key_head_dim"]),
           int(cfg["linear_value_head_dim"]), int(cfg.get("linear_conv_kernel_dim") or 4))
    return {"linear_layers": sum(fam.linear_attention.pattern(ns)), "gdn": gdn,
            "attention_output_gate": fam.attention_output_gate}


def family_of_dict(cfg: dict[str, Any]) -> Any:
    """The family of a config.json: by architectures (Kimi-K2 names DeepSeek-V3's), else by model_type."""
    from mrl.families import SUPPORTED_ARCHITECTURES

    for arch in cfg.get("architectures") or []:
        if arch in SUPPORTED_ARCHITECTURES:
            return FAMILIES[SUPPORTED_ARCHITECTURES[arch]]
    return FAMILIES.get(str(cfg.get("model_type")))


def _shared_expert_size(cfg: dict[str, Any]) -> int:
    """The family's shared-expert width (``MoE.shared_expert_size``: Qwen2-MoE's shared_expert_intermediate_size,
    DeepSeek's n_shared_experts * moe_intermediate_size); 0 without one."""
    fam = family_of_dict(cfg)
    if fam is None or fam.moe is None:
        return int(_get(cfg, "shared_expert_intermediate_size", default=0))
    return int(fam.moe.shared_expert_size(SimpleNamespace(**cfg)))


def _mla(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    return (int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]), int(cfg["qk_nope_head_dim"]),
            int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"]))


def _dsa(cfg: dict[str, Any], fam: Any) -> tuple[int, int, int] | None:
    if fam is None or fam.dsa is None:
        return None
    d = fam.dsa(SimpleNamespace(**cfg))
    return int(d["n_heads"]), int(d["head_dim"]), int(d["topk"])


def _moe_layers(cfg: dict[str, Any]) -> int | None:
    """How many layers are MoE when the family's rule (``MoE.layers``: Qwen's decoder_sparse_step /
    mlp_only_layers) makes some dense, else None."""
    fam = family_of_dict(cfg)
    if fam is None or fam.moe is None:
        return None
    pattern = fam.moe.layers(SimpleNamespace(**cfg))
    return None if all(pattern) else sum(pattern)


def read_model_shape(path: str) -> ModelShape | None:
    """Shape of the checkpoint at ``path``; None when ``path/config.json`` does not exist (yet).

    Raises ValueError naming the file when it exists but cannot be parsed.
    """
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    try:
        return shape_from_dict(json.loads(f.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{f}: cannot read the model architecture ({type(e).__name__}: {e}); fix: point model.path at a HF checkpoint") from e


HUB_SHAPES = Path(__file__).with_name("hub_shapes")


def bundled_hub_shape(model_path: str) -> ModelShape | None:
    """Shape of a hub id (``org/name``) from mrl's copy of its config.json (``hub_shapes/org--name.json``):
    what `mrl plan` checks a GPU recipe against on a host without the model. None for other paths."""
    parts = model_path.split("/")
    if len(parts) != 2 or Path(model_path).exists():
        return None
    f = HUB_SHAPES / f"{parts[0]}--{parts[1]}.json"
    return shape_from_dict(json.loads(f.read_text())) if f.is_file() else None
