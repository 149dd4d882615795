"""Multi-latent attention (DeepSeek-V3) through the actor on packed rows.

Megatron's MLA reads any packed row as THD: it drops the batch dim and applies RoPE per sequence by ``cu_seqlens``
(positions restart at each sequence). mrl hands MLA models ``PackedSeqParams(qkv_format="thd")`` and its SDPA core
attention takes ``[T, heads, d]``; with the GQA models' ``"sbhd"`` the MLA forward failed outright. Checked: the
actor's log-probs of a ragged batch (tiny DeepSeek-V3 of tests/helpers/tiny_deepseek.py: MLA with q_lora, YaRN, a
dense first layer, group-limited sigmoid routing) equal transformers' on padded and on packed rows, and one
forward+backward gives the same gradient on both layouts.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_deepseek import make_tiny_deepseek_hf
from tests.workers._mla_rank import padded_and_packed
from tests.workers.batches import ragged_batch

pytestmark = pytest.mark.timeout(300)

LP_TOL = 1e-5  # fp32; measured 4.8e-7 on both layouts
GRAD_TOL = 1e-5  # |g_packed - g_padded| / |g_padded|


def _hf_log_probs(path) -> torch.Tensor:
    """transformers' own forward of the padded batch (positions from the batch, no mrl input builder)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rb = ragged_batch(vocab=96)
    P = rb.input_ids.shape[1] - rb.responses.shape[1]
    with torch.no_grad():
        logits = model(input_ids=rb.input_ids, attention_mask=rb.attention_mask, position_ids=rb.position_ids).logits
    lp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(2, rb.responses[..., None])[..., 0]
    return lp * rb.response_mask, rb.response_mask.bool()


def test_mla_actor_on_packed_rows_equals_transformers_and_the_padded_rows(tmp_path) -> None:
    path = make_tiny_deepseek_hf(tmp_path / "ds")
    r = run_ranks(padded_and_packed, 1, args=(str(path),), timeout_s=280)[0]
    ref, mask = _hf_log_probs(path)
    for packed in (False, True):
        d = float((r["lp"][packed] - ref)[mask].abs().max())
        assert d <= LP_TOL, f"packed={packed}: max |actor - transformers| {d:.3g}"
    assert r["qkv_format"] == ["thd"]  # the packed forwards ran as THD (the padded ones pass no PackedSeqParams)
    g0, g1 = r["grad"][False], r["grad"][True]
    assert float(g0.norm()) > 0
    rel = float((g1 - g0).norm() / g0.norm())
    assert rel <= GRAD_TOL, f"|g_packed - g_padded| / |g_padded| = {rel:.3g}"
