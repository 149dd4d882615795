"""The hybrid-attention quickstart's assets, locally: ``python -m mrl.quickstarts qwen3_5``.

The quickstart's task, tokenizer, data and warm start (:mod:`mrl.quickstarts.base`) with a tiny **Qwen3.5** in its
released vision-language checkpoint form (``Qwen3_5ForConditionalGeneration``: the decoder under
``model.language_model.``, a one-block vision tower under ``model.visual.``, built frozen and fed no pictures by this text task): hidden 64,
4 layers — 3 Gated DeltaNet linear-attention layers and 1 gated full-attention layer (``layer_types``
linear, linear, linear, full: the released 3 : 1 pattern), 4 heads / 2 KV heads of 16 with partial RoPE (0.25),
q/k norms and the output gate; the linear layers with 2 key heads and 4 value heads of 16, conv kernel 4;
zero-centred RMSNorms; untied embeddings, vocab 300. ``mrl_configs/quickstart_qwen3_5.yaml`` trains it with GRPO on
the 2 CPU ranks, packed rows (the Gated DeltaNet state restarts at every packed sequence).
"""
from __future__ import annotations

from mrl.quickstarts.base import QWEN2_SHAPE, _add_arguments, writer
from mrl.quickstarts.cli import Demo

MODEL_DIR = "tiny-qwen3_5"
OUT = "outputs/quickstart_qwen3_5"
SEED = 0
TEXT_SHAPE = {
    **{k: v for k, v in QWEN2_SHAPE.items() if k not in ("tie_word_embeddings", "rope_theta")},
    "head_dim": 16, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
VISION_SHAPE = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}


def qwen3_5_config():
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=TEXT_SHAPE, vision_config=VISION_SHAPE, tie_word_embeddings=False,
                         pad_token_id=QWEN2_SHAPE["pad_token_id"], eos_token_id=QWEN2_SHAPE["eos_token_id"],
                         bos_token_id=QWEN2_SHAPE["bos_token_id"])


DEMO = Demo("qwen3_5", "the hybrid-attention quickstart: a tiny Qwen3.5 (Gated DeltaNet + gated attention, "
            "vision-language checkpoint form) on the quickstart's task", OUT, SEED, _add_arguments,
            writer(MODEL_DIR, qwen3_5_config))
