"""Context parallelism splits an update's activation memory: the per-rank peak growth of one update on a
8192 + 256-token packed row at CP=2 against CP=1 (tiny qwen2: 2 layers, hidden 64, 2 query heads / 1 KV head,
vocab 300; fp32, sdpa, packed rows).

Each rank builds the actor, warms it up with one update on a short batch (optimizer state, kernels, RoPE tables),
reads ``ru_maxrss`` as its baseline, runs one ``update_policy`` on the long batch and reads ``ru_maxrss`` again: the
growth is that update's peak (method of tests/workers/test_long_sequences.py). CP=1 runs on one rank, CP=2 on two;
the CP=2 figure is the larger of its two ranks'.

What CP=2 keeps per rank: half of every layer's activations and of the logits, plus what each rank holds whole
(the row's gathered K/V, the gathered per-position log-probs). Measured (2-core box, OMP_NUM_THREADS 1 and 2): CP=1
138-156 MiB, CP=2 85-95 MiB per rank, ratio 0.59-0.63 since the CPU flash calls read each KV head once per query
head of its group instead of keys expanded to the query heads (which kept rep copies of every prefix for the
backward: 0.64-0.68 then, CP=2 95-103 MiB). Ideal 0.5; no split would be 1.0. Bound ``MAX_RATIO`` = 0.75. The test fails where it should: the CP
attention through explicit ``[c, (j+1)·c]`` chunk masks (the maskless path of mrl/megatron/blockwise_attention.py
switched off) gave 148 -> 250 MiB per rank, ratio 1.69.
"""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(300)]

LONG, SHORT = 8192, 256
MAX_RATIO = 0.75


def _peak(rank, world, path):
    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers._long_seq_rank import PROMPT, _maxrss_mib, long_batch

    cfg = ActorConfig(megatron={"attention_backend": "sdpa", "context_parallel_size": world}, use_remove_padding=True,
                      ppo_micro_batch_size_per_gpu=2, use_distributed_optimizer=False, use_kl_loss=True,
                      kl_loss_coef=0.1, entropy_coeff=0.01, optim={"lr": 1e-4, "clip_grad": 1.0})
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=2, seed=1234, remove_padding=True,
                        attention_backend="sdpa")
    actor.update_policy(long_batch([PROMPT + 64, PROMPT + 32], actor.vocab_size, seed=1))
    base = _maxrss_mib()
    m = actor.update_policy(long_batch([LONG, SHORT], actor.vocab_size, seed=LONG))
    return {"delta": _maxrss_mib() - base, "grad_norm": float(m["actor/grad_norm"]), "loss": float(m["actor/pg_loss"])}


def test_cp2_update_peak_memory_per_rank_is_at_most_0_75_of_cp1(tmp_path) -> None:
    path = make_tiny_hf(tmp_path / "qwen2", "qwen2", num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=LONG + SHORT)
    cp1 = run_ranks(_peak, 1, args=(str(path),), timeout_s=140)[0]
    cp2 = run_ranks(_peak, 2, args=(str(path),), timeout_s=140)
    worst = max(r["delta"] for r in cp2)
    per_rank = " / ".join(f"{r['delta']:.1f}" for r in cp2)
    figures = (f"peak growth of one update at {LONG}+{SHORT} tokens: CP=1 {cp1['delta']:.1f} MiB, CP=2 "
               f"{per_rank} MiB per rank: ratio {worst / cp1['delta']:.2f} "
               f"(bound {MAX_RATIO})")
    print(figures)
    # the same update: the same loss and gradient norm (fp32; grad norm of a sum over ~8k tokens)
    for r in cp2:
        assert r["loss"] == pytest.approx(cp1["loss"], rel=1e-5, abs=1e-7)
        assert r["grad_norm"] == pytest.approx(cp1["grad_norm"], rel=1e-4)
    assert cp1["delta"] > 0 and worst <= MAX_RATIO * cp1["delta"], figures
