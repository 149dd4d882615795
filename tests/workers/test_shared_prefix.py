"""actor.shared_prefix: one row per prompt, each sample's response in its own masked segment.

Unit: the layout (fewer tokens; every response token is predicted from its own column with its own
position; segments do not see each other; the split keeps a prompt's samples together).
Multi-rank: the same log-probs, loss and DP-reduced gradients as the HF model on the unshared batch
(``reference_impl``: full batch, one process) under TP, PP and DP, with
micro-batches that hold whole groups, split groups and single samples — at the tolerances of
tests/workers/test_layout_invariance.py.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

LAYOUTS = [  # (tp, pp, sequence_parallel, micro_batch_size): 16 samples = 4 prompts x 4
    (1, 1, False, 3),  # DP4: 4 samples per rank, micro-batches of 3 and 1 (a split group, a single sample)
    (2, 1, False, 8),  # DP2, TP2 (sequence parallelism needs Apex/TE norms: not on CPU)
    (1, 2, False, 4),  # DP2, PP2: 2 micro-batches per rank, padded to one length with their masks
    (2, 2, False, 4),  # DP1: 4 micro-batches
]
TEMPERATURE = 0.7


def _check_layout(b):
    """Every response token is predicted from a column that holds the token before it, at that token's
    position, attending to exactly the sample's own earlier tokens; P + Σ (r_i − 1) tokens per group."""
    from mrl.workers.minibatch import build_model_inputs, build_shared_prefix_inputs

    sh, co = build_shared_prefix_inputs(b), build_model_inputs(b)
    assert sh.tokens.shape[0] == 4
    P = b.prompt_length
    am = b.attention_mask.bool()
    # P + Σ (r_i − 1) tokens per group: the prompt once, no response's last token
    p_len, r_len = am[:, :P].sum(-1), am[:, P:].sum(-1)
    want = sum(int(p_len[g * 4]) + int((r_len[g * 4:(g + 1) * 4] - 1).clamp(min=0).sum()) for g in range(4))
    assert int(sh.num_tokens.sum()) == want < int(co.num_tokens.sum())
    for i in range(b.batch_size):
        row = int(sh.resp_row[i])
        assert row == int(sh.resp_row[(i // 4) * 4])  # one row per prompt
        own = b.input_ids[i][am[i]]  # the sample's own sequence, and the positions of its tokens
        own_pos = b.position_ids[i][am[i]]
        for j in range(b.response_length):
            if not bool(am[i, P + j]):
                continue
            c = int(sh.resp_index[i, j])
            before = int(p_len[i]) + int(am[i, P:P + j].sum())  # tokens of the sample before response token j
            first = int(am[i, P:P + j].sum()) == 0
            assert bool(sh.resp_first[i, j]) == first
            if first:  # the prompt's last column predicts every sample's first token (one label per sample)
                assert c == int(sh.first_col[i]) and int(sh.first_label[i]) == int(b.input_ids[i, P + j])
            else:
                assert int(sh.labels[row, c]) == int(b.input_ids[i, P + j])  # predicted from column c
            assert int(sh.tokens[row, c]) == int(own[before - 1])  # ...which holds the token before it
            assert int(sh.position_ids[row, c]) == int(own_pos[before - 1])  # at that token's own position
            seen = sh.tokens[row][~sh.attention_mask[row, 0, c]]  # what column c attends to
            assert seen.tolist() == own[:before].tolist()  # exactly its prompt and its own earlier response tokens


def test_layout_computes_each_prompt_once_and_keeps_each_sample_context():
    from mrl.workers.minibatch import split_by_prompt
    from tests.workers.batches import grouped_batch

    b = grouped_batch(groups=4, n=4)
    _check_layout(b)
    # a sample without response tokens takes no column; a one-token response is its segment's only column
    am = b.attention_mask.clone()
    P = b.prompt_length
    am[5, P:] = 0
    am[6, P + 1:] = 0
    _check_layout(dataclasses.replace(b, attention_mask=am, response_mask=b.response_mask * am[:, P:]))
    # split: a prompt's samples adjacent, every sample once
    parts = split_by_prompt(b, 3)
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(16)) and [len(p) for p in parts] == [3, 3, 3, 3, 3, 1]
    groups = [i // 4 for i in flat]
    assert sum(groups[k] != groups[k + 1] for k in range(15)) == 3  # 4 prompts, each one contiguous run


def _rank(rank, world, path):
    from megatron.core import parallel_state as ps

    from mrl.config.actor import ActorConfig
    from mrl.workers.actor import ActorWorker
    from tests.workers.batches import grouped_batch, portable
    from tests.workers.test_layout_invariance import _grads_by_hf_name, _specs

    batch = grouped_batch(groups=4, n=4)
    specs = {k: v for k, v in _specs().items() if k in {("token-mean", "pg+ent+kl"), ("seq-mean-token-sum-norm", "pg")}}
    results = []
    for tp, pp, sp, mbs in LAYOUTS:
        cfg = ActorConfig(
            megatron={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "sequence_parallel": sp},
            ppo_micro_batch_size_per_gpu=mbs, use_distributed_optimizer=False, shared_prefix=True,
            use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.05, loss_agg_mode="token-mean",
        )
        actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=16, temperature=TEMPERATURE,
                            max_response_length=16, seed=1234)
        e = actor.model
        keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
        lp, ent = actor.compute_log_prob(batch)
        local = e.dp_shard(batch)
        per_spec = {}
        for key, spec in specs.items():
            actor.loss_spec = spec
            m = actor.forward_backward(local)
            grads = _grads_by_hf_name(actor)  # collective over TP
            per_spec[key] = (m["loss"], grads if keep else None)
        results.append({"layout": (tp, pp, sp, mbs), "lp": lp, "ent": ent, "per_spec": per_spec})
        del actor
    return portable(results)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_shared_prefix_equals_full_batch_reference_under_every_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.workers.batches import grouped_batch, tensors
    from tests.workers.reference_impl import hf_log_probs, hf_loss_and_grads
    from tests.workers.test_layout_invariance import _merge, _specs

    path = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    res = tensors(run_ranks(_rank, 4, args=(str(path),), timeout_s=840))
    batch = grouped_batch(groups=4, n=4)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        ref_lp, ref_ent = hf_log_probs(model, batch, TEMPERATURE)
    for li, layout in enumerate(LAYOUTS):
        assert res[0][li]["layout"] == layout
        for r in res:
            torch.testing.assert_close(r[li]["lp"], ref_lp, rtol=0, atol=1e-5)
            torch.testing.assert_close(r[li]["ent"], ref_ent, rtol=0, atol=1e-5)
        for key in res[0][li]["per_spec"]:
            spec = dataclasses.replace(_specs()[key], temperature=TEMPERATURE)
            ref_loss, ref_grads = hf_loss_and_grads(model, batch, spec)
            for r in res:
                assert r[li]["per_spec"][key][0] == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), (layout, key)
            grads = _merge(res, li, lambda x, k=key: x["per_spec"][k][1])
            assert set(grads) == set(ref_grads)
            for name, g_ref in ref_grads.items():
                scale = float(g_ref.abs().max())
                assert scale > 0, name
                torch.testing.assert_close(grads[name], g_ref, rtol=1e-5, atol=1e-5 * scale,
                                           msg=lambda m, n=name, k=key, lay=layout: f"{lay} {k} {n}: {m}")
