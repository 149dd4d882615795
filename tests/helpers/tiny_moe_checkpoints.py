"""Tiny mixture-of-experts Hugging Face checkpoints for the engine's tests (no downloads).

``make_tiny_moe_hf(path, family)`` writes config.json + model.safetensors (transformers' ``save_pretrained``,
which stores the experts per expert under the checkpoint names) for ``qwen3_moe``, ``mixtral`` or
``qwen2_moe`` (shared expert + its sigmoid gate; ``mlp_only_layers=[0]`` makes layer 0 dense, so the
routed-experts rows of a dense layer are exercised) or ``glm4_moe`` (GLM-4.5: sigmoid router with a non-zero
score-correction bias, partial RoPE, qkv bias, q/k norm; ``first_k_dense_replace=1``: layer 0 dense);
``gpt_oss`` (:data:`GPT_OSS`, not in :data:`FAMILIES`: its checkpoint holds the experts fused; attention sinks, a
4-token window on layer 0, a clamp that bites). 2 layers, hidden 32, 4 experts, top-2, vocab 96.
Router weights are scaled up so that top-2 choices are well separated (no near-ties between the engine's
batched forward and an unbatched reference).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe")  # per-expert checkpoint names
GPT_OSS = "gpt_oss"
NUM_EXPERTS, TOP_K, LAYERS = 4, 2, 2
_COMMON = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": LAYERS,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
           "num_experts_per_tok": TOP_K, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
           "tie_word_embeddings": False}


def moe_config(family: str, **overrides):
    import transformers as tf

    kw = dict(_COMMON)
    if family == "qwen3_moe":
        cls = tf.Qwen3MoeConfig
        kw.update(num_experts=NUM_EXPERTS, moe_intermediate_size=16, head_dim=8, norm_topk_prob=True)
    elif family == "mixtral":
        cls = tf.MixtralConfig
        kw.update(num_local_experts=NUM_EXPERTS)
    elif family == "qwen2_moe":
        cls = tf.Qwen2MoeConfig
        kw.update(num_experts=NUM_EXPERTS, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                  mlp_only_layers=[0])
    elif family == GPT_OSS:
        cls = tf.GptOssConfig
        kw.update(num_local_experts=NUM_EXPERTS, head_dim=8, sliding_window=4, swiglu_limit=0.5)
    elif family == "glm4_moe":
        cls = tf.Glm4MoeConfig
        kw.update(n_routed_experts=NUM_EXPERTS, moe_intermediate_size=16, n_shared_experts=1, head_dim=8,
                  partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, first_k_dense_replace=1,
                  n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    else:
        raise ValueError(f"unknown tiny MoE family {family!r}; one of {FAMILIES + (GPT_OSS,)}")
    kw.update(overrides)
    return cls(**kw)


def build_tiny_moe(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(moe_config(family, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.05 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.copy_(1.0 * torch.randn_like(p))  # routers: well-separated logits
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM's router bias: it decides some of the top-k
                b.copy_(0.5 * torch.randn_like(b))
    return model.eval()


def make_tiny_moe_hf(path: str | os.PathLike, family: str = "qwen3_moe", seed: int = 0, **overrides) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tiny_moe(family, seed=seed, **overrides).save_pretrained(path, safe_serialization=True)
    return path


def reference_topk(model, tokens: list[int]) -> torch.Tensor:
    """The routed-experts oracle: int32 ``[len(tokens), layers, top_k]``, the top-k of softmax(router logits) of
    each MoE layer in one unbatched forward of ``tokens`` (``output_router_logits``); 0 for dense layers. GLM-4.5
    (one expert group): the top-k of sigmoid(router logits) + the layer's score-correction bias."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert len(out.router_logits) == len(moe_layers)
    ref = torch.zeros(len(tokens), len(model.model.layers), model.config.num_experts_per_tok, dtype=torch.int32)
    for i, logits in zip(moe_layers, out.router_logits):
        if model.config.model_type == "glm4_moe":
            assert model.config.n_group == 1, "the oracle has no group-limited top-k"
            scores = torch.sigmoid(logits.float()) + model.model.layers[i].mlp.gate.e_score_correction_bias
        else:
            scores = torch.softmax(logits.float(), dim=-1)
        ref[:, i] = torch.topk(scores, ref.shape[-1], dim=-1).indices.to(torch.int32)
    return ref


def checkpoint_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Each parameter's ``.grad`` under its checkpoint name: transformers' fused experts split per expert
    (``gate_up_proj[e] = [gate_proj_e; up_proj_e]``, ``down_proj[e] = down_proj_e``); None where no gradient."""
    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = p.shape[1] // 2
            for e in range(p.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = p.grad[e, :half]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = p.grad[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(p.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = p.grad[e]
        else:
            out[name] = p.grad
    return out
