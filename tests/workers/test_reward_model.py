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
    return w.compute(ragged_batch())


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


# An RM with its own tokenizer and chat template (reward_model.model.input_tokenizer, verl's
# _switch_chat_template): the actor's batch (its tokenizer, prompts left-padded, responses
# right-padded, EOS at the end) is decoded and re-rendered by mrl.driver.rm_reward, then scored.
PROMPTS = [
    [{"role": "system", "content": "add"}, {"role": "user", "content": "what is 3 + 4 ?"}],
    "question: what is 12 + 30 ? answer:",
    [{"role": "user", "content": "what is 7 + 8 ?"}],
    "question: what is 1 + 1 ? answer:",
    [{"role": "user", "content": "2 + 2 = ?"}],
    "question: what is 9 + 0 ? answer:",
    [{"role": "user", "content": "what is 5 + 6 ?"}],
]
RESPONSES = [" 7", " 42 because 12 + 30 = 42", " 15", " 3", " four", " 9", " 11 is the sum"]


def actor_batch(actor_tok):
    """The actor's TrainBatch of PROMPTS x RESPONSES (+ EOS) and its Prompt records."""
    from mrl.data.dataset import Prompt
    from mrl.data.tokenize import encode_prompt, left_pad, position_ids_from_mask
    from mrl.workers.batch import TrainBatch

    prompts = [Prompt(encode_prompt(actor_tok, p), p, "0") for p in PROMPTS]
    p_ids, p_mask = left_pad([p.prompt_ids for p in prompts], 0)
    resp = [actor_tok(r, add_special_tokens=False)["input_ids"] + [actor_tok.eos_token_id] for r in RESPONSES]
    R = max(map(len, resp))
    r_ids, r_mask = torch.zeros(len(resp), R, dtype=torch.long), torch.zeros(len(resp), R, dtype=torch.long)
    for i, r in enumerate(resp):
        r_ids[i, :len(r)], r_mask[i, :len(r)] = torch.tensor(r), 1
    am = torch.cat([p_mask, r_mask], 1)
    return TrainBatch(input_ids=torch.cat([p_ids, r_ids], 1), attention_mask=am,
                      position_ids=position_ids_from_mask(am), responses=r_ids, response_mask=r_mask), prompts


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rm_with_its_own_tokenizer_matches_transformers(tmp_path: Path, family: str) -> None:
    import transformers as tf

    from mrl.driver.rm_reward import rm_input_batch
    from tests.helpers.tiny_tokenizer import (
        CHATML_TEMPLATE,
        add_chat_template,
        save_other_tokenizer,
    )

    actor_dir = tmp_path / "actor"
    save_tiny_tokenizer(actor_dir)
    add_chat_template(actor_dir, CHATML_TEMPLATE)
    path = make_tiny_rm(tmp_path / "rm", family)
    vocab = save_other_tokenizer(path)  # the RM's own tokenizer replaces the tiny one: 260 ids, no merges
    actor_tok, rm_tok = tf.AutoTokenizer.from_pretrained(actor_dir), tf.AutoTokenizer.from_pretrained(path)
    batch, prompts = actor_batch(actor_tok)
    assert bool((batch.attention_mask[:, 0] == 0).any()) and bool((batch.response_mask[:, -1] == 0).any())  # padded
    rm_batch = rm_input_batch(batch, prompts, actor_tok, rm_tok)
    assert int(rm_batch.input_ids.max()) < vocab <= 300

    rm = tf.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # the oracle: the RM's template over the source texts, unpadded, one at a time
        one = []
        for p, r in zip(PROMPTS, RESPONSES, strict=True):
            chat = ([{"role": "user", "content": p}] if isinstance(p, str) else p) + [{"role": "assistant", "content": r}]
            ids = rm_tok(rm_tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
            one.append(rm(input_ids=torch.tensor([ids])).logits[0, 0])
        one = torch.stack(one)
        # and HF on the re-rendered right-padded batch (its pad id: the last non-pad token)
        padded = rm(input_ids=rm_batch.input_ids, attention_mask=rm_batch.attention_mask).logits[:, 0]
    torch.testing.assert_close(padded, one, rtol=0, atol=1e-5)
    assert float(one.std()) > 0.05
    for tp, pp, world in ((1, 1, 2), (2, 2, 4)):  # TP1 at DP2 (7 samples: the worker pads to 8), TP2xPP2
        scores = run_ranks(_rank_on, world_size=world, args=(str(path), tp, pp, rm_batch), timeout_s=600)
        for r in range(world):
            torch.testing.assert_close(scores[r], one, rtol=0, atol=1e-5, msg=f"{family} TP{tp}xPP{pp} rank {r}")


def _rank_on(rank, world, path, tp, pp, batch):
    from mrl.config.parallel import ParallelConfig
    from mrl.workers.reward_model import RewardModelWorker

    w = RewardModelWorker(path, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                          micro_batch_size=3, seed=1234)
    return w.compute(batch)


def _offload_rank(rank, world, path):
    from mrl.config.parallel import ParallelConfig
    from mrl.workers.reward_model import RewardModelWorker
    from tests.workers.batches import ragged_batch

    w = RewardModelWorker(path, ParallelConfig(), micro_batch_size=4, seed=1234)
    before = w.compute(ragged_batch())
    w.offload(force=True)  # CPU: forced, so the storages really are freed and restored
    freed = all(p.untyped_storage().nbytes() == 0 for c in w.model.chunks for p in c.parameters())
    w.onload()
    return before, freed, w.compute(ragged_batch())


def test_offload_round_trip_keeps_the_scores(tmp_path: Path) -> None:
    path = make_tiny_rm(tmp_path / "rm", "qwen2")
    before, freed, after = run_ranks(_offload_rank, world_size=1, args=(str(path),), timeout_s=300)[0]
    assert freed
    torch.testing.assert_close(after, before, rtol=0, atol=0)
