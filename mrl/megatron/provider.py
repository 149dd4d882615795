"""Hugging Face ``config.json`` → Megatron-Core ``TransformerConfig`` + ``GPTModel`` chunks.

Supported dense decoder families (``architectures`` in config.json): Llama 2/3 (incl. llama3
rope scaling), Qwen2/2.5 (qkv bias, tied embeddings), Qwen3 (per-head q/k RMSNorm), Mistral (with its
``sliding_window``: every layer windowed, on the sdpa and te backends); and the
Mixture-of-Experts families Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 and gpt-oss (attention sinks, per-layer
windows, biased clamped-SwiGLU experts, YaRN RoPE: :mod:`mrl.families.gpt_oss`) (:mod:`mrl.megatron.moe`, where the
MLP below becomes a routed sum of SwiGLU experts; layers a Qwen MoE config makes dense keep the MLP:
Megatron's ``moe_layer_freq`` list and one layer spec per layer, :func:`decoder_spec`); and the hybrid-attention
families Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next, whose Gated DeltaNet layers replace attention in most
layers (:mod:`mrl.megatron.gated_delta_net`, one spec per layer, zero-centred norms). What differs per
family (qkv bias, q/k norm, window, MoE settings, refusals) is declared in its module under :mod:`mrl.families`; this module adds the
settings common to all of them. All are pre-norm RMSNorm decoders with RoPE, GQA
and SwiGLU::

    h = x + o_proj(attn(rope(q), rope(k), v)),  q, k, v = proj(rmsnorm(x))   (RoPE on the first
                                                                        partial_rotary_factor of each head)
    y = h + down(silu(gate(rmsnorm(h))) * up(rmsnorm(h)))

The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * TP`` (Megatron's rule;
the padded rows are zero on load and dropped on export, see :mod:`mrl.megatron.mapping`).
Layer spec (``megatron.attention_backend``): Transformer Engine's (``te``), or Megatron's local spec with
torch SDPA as its core attention (``sdpa``, :mod:`mrl.megatron.sdpa_attention`) or with its unfused
``DotProductAttention`` (``local``); ``auto`` = ``te`` where TE is importable on CUDA, else ``sdpa``.
:mod:`mrl.megatron.mapping` knows both namings (TE's and the local spec's).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# SUPPORTED_ARCHITECTURES (architecture -> family key) is re-exported for the provider's callers
from mrl.families import FAMILIES, SUPPORTED_ARCHITECTURES, family_of  # noqa: F401


def load_hf_config(path: str | os.PathLike) -> Any:
    """Read ``config.json`` from an HF checkpoint directory (no network: local files only): the decoder's view of it
    (a vision-language checkpoint's ``text_config``, :func:`mrl.families.views.decoder_config`)."""
    from transformers import AutoConfig

    from mrl.families.views import decoder_config

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}/config.json not found: point the model path at a Hugging Face checkpoint "
            "directory (the one holding config.json and *.safetensors)"
        )
    return decoder_config(AutoConfig.from_pretrained(str(path), local_files_only=True))


def model_family(hf_config: Any) -> str:
    """Family key (``llama``/``qwen2``/...: :data:`mrl.families.FAMILIES`) or a clear error listing them."""
    return family_of(hf_config).name


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Smallest multiple of ``divisible_by * tp`` that is >= ``vocab_size`` (Megatron's rule)."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def head_dim(hf_config: Any) -> int:
    hd = getattr(hf_config, "head_dim", None)
    return int(hd) if hd else hf_config.hidden_size // hf_config.num_attention_heads


def _rope_params(hf_config: Any) -> tuple[float, bool, float]:
    """(rope theta, llama3 scaling on?, scaling factor) from either HF rope layout."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    src = params if params.get("rope_type") else scaling
    if rope_type in ("default", "yarn"):  # yarn: GPTModel's YaRN embedding, configured by yarn_params
        return float(theta), False, 1.0
    if rope_type == "llama3":
        # Megatron's llama3 scaling hard-codes low/high freq factors 1/4 and 8192 original positions.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        for key, val in expected.items():
            if float(src.get(key, val)) != val:
                raise ValueError(
                    f"config.json rope_scaling.{key}={src.get(key)} is not supported (Megatron's "
                    f"llama3 rope scaling uses {key}={val})"
                )
        return float(theta), True, float(src.get("factor", 8.0))
    raise ValueError(
        f"config.json rope type {rope_type!r} is not supported; supported: 'default', 'llama3', 'yarn'"
    )


def yarn_params(hf_config: Any) -> dict[str, Any] | None:
    """The ``yarn_*`` attributes Megatron's ``GPTModel(position_embedding_type="yarn")`` reads from its config, for a
    config.json with YaRN RoPE (gpt-oss); None for other rope types.

    transformers' YaRN (``_compute_yarn_parameters``) and Megatron's ``YarnRotaryEmbedding`` compute the same
    inverse frequencies (``factor``, ``beta_fast``/``beta_slow`` ramp over ``original_max_position_embeddings``;
    transformers' ``truncate`` is Megatron's ``correction_range_round_to_int``) and the same attention factor
    on cos/sin (``0.1·ln(factor) + 1``, or the ``mscale``/``mscale_all_dim`` ratio when both are set). Refused: an
    explicit ``attention_factor`` that differs from that rule, and ``partial_rotary_factor`` != 1."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    src = params if params.get("rope_type") else scaling
    if (src.get("rope_type") or src.get("type")) != "yarn":
        return None
    partial = float(src.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={partial} with YaRN RoPE is not supported (1.0 only)")
    orig = src.get("original_max_position_embeddings")
    if not orig:
        raise ValueError("config.json YaRN rope parameters lack original_max_position_embeddings")
    factor = float(src.get("factor") or hf_config.max_position_embeddings / orig)
    mscale, mscale_all_dim = src.get("mscale"), src.get("mscale_all_dim")
    ratio = bool(mscale and mscale_all_dim)  # transformers' test (truthiness), Megatron's is "both not None"

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    expected = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if ratio else get_mscale(factor)
    given = src.get("attention_factor")
    if given is not None and not math.isclose(float(given), expected, rel_tol=1e-9):
        raise ValueError(f"config.json YaRN attention_factor={given}: Megatron derives it from factor/mscale "
                         f"({expected}); a checkpoint with another attention factor is not supported")
    return {
        "yarn_rotary_scaling_factor": factor,
        "yarn_original_max_position_embeddings": int(orig),
        "yarn_beta_fast": float(src.get("beta_fast") or 32.0),
        "yarn_beta_slow": float(src.get("beta_slow") or 1.0),
        "yarn_mscale": float(mscale) if ratio else None,
        "yarn_mscale_all_dim": float(mscale_all_dim) if ratio else None,
        "yarn_correction_range_round_to_int": bool(src.get("truncate", True)),
    }
def rotary_percent(hf_config: Any) -> float:
    """Share of each head's channels RoPE rotates (``partial_rotary_factor``, GLM-4.5's 0.5): transformers rotates
    the first ``int(head_dim · f)`` channels in its half-split layout and passes the rest, as Megatron's
    ``rotary_percent`` does (not interleaved)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    f = float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None)) or 1.0)
    d = head_dim(hf_config)
    if not 0.0 < f <= 1.0 or int(d * f) % 2:
        raise ValueError(f"config.json partial_rotary_factor={f}: expected 0 < f <= 1 with head_dim * f = "
                         f"{d * f:g} rotating an even number of channels")
    return f


def _check_supported(hf_config: Any, family: str) -> None:
    """The checks common to every family, then the family's own (:meth:`mrl.families.Family.check`)."""
    fam = FAMILIES[family]
    if getattr(hf_config, "attention_bias", False) and not fam.qkv_bias:
        raise ValueError("config.json attention_bias=true is not supported for this family")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("config.json mlp_bias=true is not supported")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported (SwiGLU/silu only)")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("config.json use_sliding_window=true is not supported; set it to false")
    fam.check(hf_config)


def make_transformer_config(hf_config: Any, *, dtype: torch.dtype = torch.float32, **overrides: Any):
    """``TransformerConfig`` for ``hf_config`` under the current Megatron parallel state.

    TP/PP/VPP sizes come from ``megatron.core.parallel_state`` (call
    :func:`mrl.megatron.parallel.init_parallel` first). ``overrides`` are passed through to
    ``TransformerConfig`` (e.g. ``recompute_granularity``, ``variable_seq_lengths``).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    family = family_of(hf_config)
    _check_supported(hf_config, family.name)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"model dtype {dtype} is not supported; use float32, bfloat16 or float16")
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    on_cuda = torch.cuda.is_available()
    kw: dict[str, Any] = {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        # an all-MoE config may have no dense width (Qwen3.5-MoE): Megatron then never builds a dense MLP
        "ffn_hidden_size": getattr(hf_config, "intermediate_size", None) or hf_config.moe_intermediate_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_query_groups": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "kv_channels": head_dim(hf_config),
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": F.silu,
        "add_bias_linear": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        # Fusions need CUDA kernels (apex/TE); the unfused paths are exact in fp32.
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "attention_softmax_in_fp32": True,
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": vpp,
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "use_cpu_initialization": not on_cuda,
    }
    if family.is_moe:
        ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    else:
        ep = etp = 1
    # the family's own: add_qkv_bias, qk_layernorm, window_size, the MoE router and experts
    kw.update(family.transformer_kwargs(hf_config, ep=ep, etp=etp))
    kw.update(overrides)
    if family.is_hybrid and (kw.get("sequence_parallel") or kw["context_parallel_size"] > 1):
        # a Gated DeltaNet layer runs its recurrence over whole sequences on one rank (mrl plan refuses it first)
        raise ValueError(f"{family.name}'s Gated DeltaNet layers support neither sequence parallelism nor context "
                         "parallelism; fix: megatron.sequence_parallel=false, megatron.context_parallel_size=1")
    tcfg = (MLATransformerConfig if family.is_mla else TransformerConfig)(**kw)
    if not family.is_mla:  # MLA takes YaRN through MLATransformerConfig's own fields (the family's mla kwargs)
        # YaRN: not TransformerConfig fields; GPTModel and the attention's rotary step read them off the config
        for key, value in (yarn_params(hf_config) or {}).items():
            setattr(tcfg, key, value)
    return tcfg


def te_usable() -> bool:
    """Transformer Engine's layers can run here: TE importable (megatron-core found it) and CUDA in use."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    return torch.cuda.is_available() and bool(specs.HAVE_TE)


def resolve_attention_backend(want: str = "auto", *, lora: bool = False, mla: bool = False,
                              hybrid: bool = False) -> str:
    """``te`` | ``sdpa`` | ``local`` for ``megatron.attention_backend`` on this host (the rule and its reasons:
    :mod:`mrl.megatron.backends`, the rule ``mrl plan`` prints); ``mla``: the model has multi-latent attention,
    ``hybrid``: Gated DeltaNet layers."""
    from mrl.megatron.backends import choose_attention_backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend, _why = choose_attention_backend(want, device=device, te_importable=te_usable(), lora=lora, mla=mla,
                                             hybrid=hybrid)
    if backend == "te" and not te_usable():
        raise ValueError("megatron.attention_backend=te needs Transformer Engine on CUDA, which this process does "
                         "not have; fix: attention_backend=sdpa (or auto), or run in the image with TE (docs/gpus.md)")
    if backend == "te" and lora:
        raise ValueError("megatron.attention_backend=te with LoRA: the adapters need Megatron's local layer spec "
                         "(unfused norm + linear); fix: attention_backend=sdpa (or auto)")
    return backend


def layer_spec(hf_config: Any, *, backend: str = "sdpa", moe: bool | None = None):
    """The decoder layer spec: Transformer Engine's (``te``), or Megatron's local spec whose core attention is
    :class:`~mrl.megatron.sdpa_attention.SDPAAttention` (``sdpa``) or its unfused ``DotProductAttention``
    (``local``). ``sdpa`` and ``local`` have the same parameters (core attention has none). ``moe=False``:
    the dense layer of an MoE family (its MLP of ``intermediate_size``); None: the family's layer."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if backend not in ("te", "sdpa", "local"):
        raise ValueError(f"attention backend {backend!r}: expected te, sdpa or local (resolve auto first)")
    family = family_of(hf_config)
    need = family.layer_spec_kwargs(hf_config)  # qk_layernorm, num_experts (None: dense), multi_latent_attention
    qk, experts, mla = need["qk_layernorm"], need["num_experts"], need["multi_latent_attention"]
    if (need["linear_layers"] is not None or need["zero_centered_norm"]) and backend != "sdpa":
        # the mapping names the local spec's modules; TE has no Gated DeltaNet and fuses the norms it would replace
        raise ValueError(f"megatron.attention_backend={backend} with {family.name}'s hybrid attention: only "
                         "attention_backend=sdpa builds it; fix: megatron.attention_backend=sdpa")
    if mla and backend != "sdpa":
        # local: DotProductAttention refuses MLA's d_k != d_v; te: the mapping has no names for TE's fused MLA norms
        raise ValueError(f"megatron.attention_backend={backend} with multi-latent attention ({family.name}): only "
                         "attention_backend=sdpa builds it; fix: megatron.attention_backend=sdpa")
    if moe is False:
        experts = None
    if experts:
        from mrl.megatron.moe import ensure_megatron_moe_importable

        ensure_megatron_moe_importable()
    if backend == "te":
        # Experts as a SequentialMLP of TE linears (names as on the local spec; grouped GEMM would
        # store them as linear_fc1.weight<j>, which mapping.py does not know yet).
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk)
    if mla:
        from mrl.megatron.mla_support import ensure_megatron_mla_importable

        ensure_megatron_mla_importable()
    # MLA: the local spec's q/kv latent RMSNorms exist only with qk_layernorm=True
    spec = specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk or mla,
                                          normalization="RMSNorm", multi_latent_attention=mla)
    if experts and family.moe is not None and family.moe.expert_linear_bias:
        from mrl.megatron.moe import expert_row_parallel_linear

        # biased experts: fc2 without the identity reduce whose view the in-place bias add trips over in backward
        spec.submodules.mlp.submodules.experts.submodules.linear_fc2 = expert_row_parallel_linear()
    if backend == "sdpa":
        from mrl.megatron.sdpa_attention import SDPAAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAAttention
        if family.dsa is not None:
            spec.submodules.self_attention.submodules.core_attention = _dsa_core_attention(hf_config)
    return spec


def _dsa_core_attention(hf_config: Any):
    """DeepSeek sparse attention's core attention (:mod:`mrl.megatron.dsa`), with the family's indexer RoPE layout."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mrl.megatron.dsa import DSAAttention

    interleaved = bool(family_of(hf_config).dsa(hf_config)["rope_interleaved"])
    return ModuleSpec(module=DSAAttention, params={"rope_interleaved": interleaved})


def _hybrid_specs(hf_config: Any, base: Any) -> dict[int, Any]:
    """{1: the linear-attention layer's spec, 0: the full-attention layer's} of a hybrid family, from the family's
    ``base`` layer spec: Gated DeltaNet as the token mixer of the former; zero-centred norms in both where the family
    says so (:mod:`mrl.megatron.gated_delta_net`)."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    from mrl.megatron.gated_delta_net import GatedDeltaNet, ZeroCenteredRMSNorm

    zero = family_of(hf_config).zero_centered_norm
    full = copy.deepcopy(base)
    if zero:
        full.submodules.input_layernorm = ZeroCenteredRMSNorm
        full.submodules.pre_mlp_layernorm = ZeroCenteredRMSNorm
        full.submodules.self_attention.submodules.q_layernorm = ZeroCenteredRMSNorm
        full.submodules.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    linear = copy.deepcopy(full)
    linear.submodules.self_attention = ModuleSpec(module=GatedDeltaNet)
    return {1: linear, 0: full}


def decoder_spec(hf_config: Any, tcfg: Any, *, backend: str = "sdpa", vp_stage: int | None = None):
    """What ``GPTModel`` gets as ``transformer_layer_spec`` for this rank's (virtual) pipeline stage: the one
    :func:`layer_spec` when every layer is alike; for an MoE model with dense layers (``moe_layer_freq`` a
    list, :meth:`mrl.families.base.MoE.layer_pattern`) a ``TransformerBlockSubmodules`` with the stage's
    layers, each the MoE or the dense spec of its *global* index (as megatron's ``get_gpt_decoder_block_spec``
    slices them, with mrl's backend choice in every layer)."""
    need = family_of(hf_config).layer_spec_kwargs(hf_config)
    pattern, linear = need["moe_layers"], need["linear_layers"]
    if pattern is None and linear is None and not need["zero_centered_norm"]:
        return layer_spec(hf_config, backend=backend)
    from megatron.core.transformer import transformer_block as tb
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if pattern is None:  # hybrid (or zero-centred) without dense MLP layers among MoE ones: one MLP kind
        if tcfg.pipeline_model_parallel_layout is not None:
            raise ValueError("a custom pipeline_model_parallel_layout with hybrid attention layers is not supported")
        from mrl.megatron.gated_delta_net import ZeroCenteredRMSNorm

        kinds = _hybrid_specs(hf_config, layer_spec(hf_config, backend=backend))
        mixers = linear or [0] * int(hf_config.num_hidden_layers)
        offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)
        count = tb.get_num_layers_to_build(tcfg, vp_stage=vp_stage)
        norm = ZeroCenteredRMSNorm if need["zero_centered_norm"] else tb.LayerNormImpl
        return tb.TransformerBlockSubmodules(layer_specs=[kinds[mixers[g]] for g in range(offset, offset + count)],
                                             layer_norm=norm)
    if linear is not None:
        raise ValueError("a hybrid-attention model whose MoE layers mix with dense MLP layers is not supported")

    if not isinstance(tcfg.moe_layer_freq, list) or list(tcfg.moe_layer_freq) != pattern:
        raise ValueError(f"TransformerConfig moe_layer_freq={tcfg.moe_layer_freq} differs from config.json's "
                         f"dense/MoE layers {pattern}")
    if tcfg.pipeline_model_parallel_layout is not None:
        raise ValueError("a custom pipeline_model_parallel_layout with mixed dense/MoE layers is not supported")
    kinds = {1: layer_spec(hf_config, backend=backend, moe=True), 0: layer_spec(hf_config, backend=backend, moe=False)}
    offset = get_transformer_layer_offset(tcfg, vp_stage=vp_stage)
    count = tb.get_num_layers_to_build(tcfg, vp_stage=vp_stage)
    return tb.TransformerBlockSubmodules(layer_specs=[kinds[pattern[g]] for g in range(offset, offset + count)],
                                         layer_norm=tb.LayerNormImpl)


def build_model_chunks(
    hf_config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    wrap_ddp: bool = False,
    ddp_config: Any = None,
    make_vocab_size_divisible_by: int = 128,
    share_embeddings_and_output_weights: bool | None = None,
    config_overrides: dict[str, Any] | None = None,
    attention_backend: str = "sdpa",
) -> list:
    """One ``GPTModel`` per virtual pipeline stage of this rank (a list of length VPP or 1).

    Each chunk gets ``pre_process``/``post_process`` from its (pp_rank, vp_stage), random init
    (fill it with :func:`mrl.megatron.mapping.load_hf_weights`). bf16/fp16 chunks are wrapped in
    Megatron's ``Float16Module`` (fp32 logits out). With ``wrap_ddp`` the chunks are
    wrapped in Megatron ``DistributedDataParallel`` (default config: fp32 grad reduce, no
    overlap; bucketing only on the first chunk, as Megatron-LM does).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    tcfg = make_transformer_config(hf_config, dtype=dtype, **(config_overrides or {}))
    # MLA attention builds its own (YaRN) rotary embedding from the config; GPTModel's is unused then
    theta, rope_scaling, rope_factor = (10000.0, False, 1.0) if family_of(hf_config).is_mla else _rope_params(hf_config)
    tied = (
        bool(getattr(hf_config, "tie_word_embeddings", False))
        if share_embeddings_and_output_weights is None
        else share_embeddings_and_output_weights
    )
    if tcfg.window_size and attention_backend == "local" and not torch.cuda.is_available():
        raise ValueError("config.json sliding_window: Megatron's local attention builds its window mask on CUDA only; "
                         "fix: megatron.attention_backend=sdpa (or auto)")
    from mrl.megatron.vision import vision_tower_of

    if vision_tower_of(hf_config) is not None:
        from mrl.megatron.vision import check_vision

        check_vision(hf_config, sequence_parallel=tcfg.sequence_parallel, context_parallel=tcfg.context_parallel_size)
    vocab = padded_vocab_size(hf_config.vocab_size, tcfg.tensor_model_parallel_size, make_vocab_size_divisible_by)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for vp_stage in range(vpp):
        stage_kw = {"ignore_virtual": False, "vp_stage": vp_stage} if vpp > 1 else {}
        # te | sdpa | local (resolve_attention_backend); per layer when dense and MoE layers mix
        spec = decoder_spec(hf_config, tcfg, backend=attention_backend, vp_stage=vp_stage if vpp > 1 else None)
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(**stage_kw),
            post_process=ps.is_pipeline_last_stage(**stage_kw),
            parallel_output=True,
            share_embeddings_and_output_weights=tied,
            position_embedding_type="yarn" if hasattr(tcfg, "yarn_rotary_scaling_factor") else "rope",
            rotary_base=theta,
            rope_scaling=rope_scaling,
            rope_scaling_factor=rope_factor,
            rotary_percent=rotary_percent(hf_config),
            vp_stage=vp_stage if vpp > 1 else None,
        )
        if vision_tower_of(hf_config) is not None:  # the tower (first stage) and multimodal RoPE
            from mrl.megatron.vision import attach

            attach(model, hf_config)
        if dtype in (torch.bfloat16, torch.float16):
            from megatron.core.transformer.module import Float16Module

            # As Megatron-LM: half-precision weights, fp32 logits out of the last stage.
            model = Float16Module(tcfg, model)
        chunks.append(model)
    if wrap_ddp:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        ddp_config = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        chunks = [
            DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
            for i, m in enumerate(chunks)
        ]
    return chunks


def hf_config_dict(path: str | os.PathLike) -> dict[str, Any]:
    """Raw config.json as a dict (for writing next to converted checkpoints)."""
    return json.loads((Path(path) / "config.json").read_text())
