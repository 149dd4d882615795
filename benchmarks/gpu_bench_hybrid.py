"""gpu_bench's ``qwen35_hybrid`` section: the actor's update step and the longest single sequence that trains at a
Qwen3.5 shape (hybrid decoder: Gated DeltaNet linear-attention layers and gated full-attention layers, 3 : 1,
partial RoPE 0.25, zero-centred norms), random weights, built as a text-only ``Qwen3_5ForCausalLM`` checkpoint.

Shape (:data:`QWEN35_4B`): Qwen3.5-4B's decoder as slime's ``scripts/models/qwen3.5-4B.sh`` states it (read through
radixark/miles, whose copy slime's file sources): 32 layers, hidden 2560, FFN 9216, 16 query heads and 4 KV groups of
``kv_channels`` 256, vocabulary 248320, rotary 25 % with base 1e7, embeddings tied (the script has no
``--untie-embeddings-and-output-weights``). The script does not state the linear-attention fields; they are
transformers 5.25's ``Qwen3_5TextConfig`` defaults (16 key heads, 32 value heads, head dims 128, conv kernel 4),
the same as Qwen3.5-35B-A3B's in mrl/config/hub_shapes/. ``layer_types``: every 4th layer full attention (8 of 32).
The 35B-A3B decoder itself is not used: 35 B parameters with Adam do not fit one GPU.

Steps (``run``; the section catches its own failures, keeps to ``--hybrid-budget-s``):

* ``update``: mrl's Megatron actor ``forward_backward`` (no optimizer step), 8 samples x 1024 tokens, micro-batch 2,
  attention backend ``sdpa``, packed rows (``actor.use_remove_padding``): the only path on which the Gated DeltaNet
  can run ``fla``'s varlen kernel (mrl/megatron/gated_delta_net.py: padded rows always take mrl's torch chunked
  delta rule). Seconds, TFLOP/s, MFU = achieved / the GPU's dense bf16 peak.
* ``longest``: gpu_bench's long-context search (forward + backward + optimizer step on one sequence, doubling from
  4096 to 131072 tokens until CUDA runs out of memory or the budget would be overrun), full activation recompute,
  packed rows (one sequence per row).

``delta_rule_kernel`` in the JSON: which gated delta rule those steps ran, by the dispatch of
``GatedDeltaNet._mix``: ``fla``'s ``chunk_gated_delta_rule`` on packed rows when it imports on CUDA, else mrl's torch
chunked path.

FLOPs of one forward+backward over T tokens in sequences of s tokens (:func:`hybrid_flops`)::

    F = 6·N·T + 12·L_full·(n_h·d_h)·s·T + 3·L_lin·n_v·(4·C·d_k + 3·C·d_v + 6·d_k·d_v)·T

* N: weights entering a matmul per token: the GDN layers' in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
  and the depthwise conv1d (K weights per channel, K MACs per channel and token); the full layers' q_proj (query and
  output gate: 2·n_h·d_h rows), k_proj, v_proj, o_proj; every layer's SwiGLU MLP (3·h·i); the LM head (V·h, tied or
  not). Forward 2·N·T, backward twice that.
* Full-attention layers only (L_full of them) have an s² term: QKᵀ and PV over n_h·d_h per token (GQA shares K/V
  but not the products), Megatron's convention: not halved for causality.
* The GDN layers have no s² term. Their chunked delta rule (mrl/megatron/delta_rule.py, chunk C = 64, one
  d_k × d_v state per value head; key heads repeated to the n_v value heads) costs per token and value head in the
  forward: K Kᵀ and Q Kᵀ within the chunk (2·2·C·d_k), the unit-lower-triangular solve of (I + A)U (C·d_v), the
  masked (QKᵀ)U product (2·C·d_v), and three state products K S_0, Q S_0, Kᵀ U (3·2·d_k·d_v); the backward counted
  as twice the forward (as for the projections). fla's kernel orders the chunk differently (WY form), so this is the
  model's count, not a kernel's. Elementwise work (norms, gates, decay, conv activation) is not counted, nor
  recomputation.
"""
from __future__ import annotations

import json
import pathlib
import time

CHUNK = 64  # mrl.megatron.delta_rule.CHUNK (and the reference kernels')

QWEN35_4B = {"vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9216, "num_hidden_layers": 32,
             "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
             "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
             "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144, "tie_word_embeddings": True,
             "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                                       "partial_rotary_factor": 0.25}}
TINY_HYBRID = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
               "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
               "linear_conv_kernel_dim": 4, "max_position_embeddings": 512, "tie_word_embeddings": True,
               "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                                         "partial_rotary_factor": 0.25}}
SIZES = {  # shape, update (samples, prompt, response), micro-batch, timed iterations, search (first, last)
    "gpu": {"shape": QWEN35_4B, "update": (8, 512, 512), "micro": 2, "iters": 2, "search": (4096, 131072)},
    "cpu-smoke": {"shape": TINY_HYBRID, "update": (4, 6, 6), "micro": 2, "iters": 1, "search": (16, 128)},
}


def layer_types(c: dict) -> list[str]:
    """Qwen3.5's pattern (transformers' default ``layer_types``): every 4th layer full attention."""
    return c.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                    for i in range(c["num_hidden_layers"])]


def hybrid_matmul_params(c: dict) -> int:
    """N of the docstring's count."""
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    kd, vd = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    gdn = h * (2 * kd + vd) + h * vd + 2 * h * nv + vd * h + c["linear_conv_kernel_dim"] * (2 * kd + vd)
    full = h * 2 * nh * hd + 2 * h * nkv * hd + nh * hd * h
    types = layer_types(c)
    n_full = types.count("full_attention")
    return n_full * full + (len(types) - n_full) * gdn + len(types) * 3 * h * i + c["vocab_size"] * h


def hybrid_flops(c: dict, tokens: int, seq: int) -> int:
    """F of the docstring for ``tokens`` tokens in sequences of ``seq``."""
    types = layer_types(c)
    n_full = types.count("full_attention")
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    delta = 3 * (len(types) - n_full) * c["linear_num_value_heads"] * (4 * CHUNK * dk + 3 * CHUNK * dv + 6 * dk * dv)
    attn = 12 * n_full * c["num_attention_heads"] * c["head_dim"] * seq
    return 6 * hybrid_matmul_params(c) * tokens + attn * tokens + delta * tokens


def is_hybrid(c: dict) -> bool:
    return "linear_num_value_heads" in c


def write_hybrid(shape: dict, dtype: str, device: str, path: pathlib.Path) -> str:
    """A random text-only ``Qwen3_5ForCausalLM`` checkpoint (built on the device: fast init)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3_5TextConfig(**shape)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    with torch.device(device):  # built in the target dtype: no fp32 copy of 4 B weights on the way
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    if type(model).__name__ != "Qwen3_5ForCausalLM":
        raise RuntimeError(f"transformers built {type(model).__name__} from a Qwen3_5TextConfig, not Qwen3_5ForCausalLM")
    model.save_pretrained(path)
    del model
    return str(path)


def delta_rule_kernel(packed: bool) -> str:
    """The gated delta rule ``GatedDeltaNet._mix`` dispatches to: fla only on packed rows where it runs."""
    from mrl.megatron.delta_rule import fla_available

    if packed and fla_available():
        return "fla chunk_gated_delta_rule (varlen, CUDA)"
    return "mrl torch chunked (mrl/megatron/delta_rule.py)"


def run(out: dict, a, size: dict, device: str, gb, tmp: pathlib.Path) -> None:
    """The section (see the module docstring); ``gb`` is gpu_bench itself (its measure and search steps)."""
    H = SIZES[out["mode"]]
    deadline = time.perf_counter() + a.hybrid_budget_s
    hsize = {**size, "shape": H["shape"], "long": {**size["long"], "search": H["search"]}}
    res: dict = {"shape": H["shape"], "layer_types": layer_types(H["shape"]), "budget_s": a.hybrid_budget_s,
                 "matmul_params": hybrid_matmul_params(H["shape"]), "delta_rule_kernel": delta_rule_kernel(True),
                 "flops": "6·N·T + 12·L_full·n_h·d_h·s·T + 3·L_lin·n_v·(4·C·d_k + 3·C·d_v + 6·d_k·d_v)·T, C = 64"}
    out["qwen35_hybrid"] = res
    t0 = time.perf_counter()
    model = write_hybrid(H["shape"], size["dtype"], device, tmp / "qwen35")
    res["write_s"] = round(time.perf_counter() - t0, 1)
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    res["architectures"] = cfg.get("architectures")
    B, P, R = H["update"]
    res["update"], _ = gb.measure_variants(out, a, hsize, model, device, [("sdpa+packed", "sdpa", True)],
                                           key="qwen35_hybrid", batch_shape=(B, P, R), micro=H["micro"],
                                           iters=H["iters"], deadline=deadline)
    gb.release(device)
    res["longest"] = gb.search_longest(out, hsize, model, device, "sdpa", True, deadline, packed=True)
    res["longest"]["first"], res["longest"]["last"] = H["search"]
