"""DeepSeek-V3.2 (DeepSeek sparse attention) through the actor: log-probs equal transformers', and one update's loss
and gradients equal an independent autograd computation through transformers in both layouts (DP4 on padded rows,
EP2 × PP2 on packed rows); the lightning indexer does not move (frozen in RL).

As tests/workers/test_qwen3_5_actor.py: ``old_log_probs`` are transformers' own, so the PPO ratio is 1 and the
token-mean loss is ``L = −Σ_t A_t r_t / N``; its gradient by autograd through transformers' padded forward
(``hf_padded_log_probs``; the indexer under transformers' ``no_grad`` gets none), the update's gradient read back from
one Adam step (lr 1e4, eps 1). Rows of up to 13 tokens against ``index_topk`` = 4: the mask cuts most rows, and every
top-k choice of each sample is checked to be far from a tie (tests/helpers/tiny_dsa.py) so float32 cannot flip it."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_ranks
from tests.workers.test_moe_families_actor import EPS, LR, _step_grads
from tests.workers.test_qwen3_5_actor import _batch, _rank, _reference

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]

# DeepSeek-V3.2 (YaRN, the half-split indexer RoPE); GLM-5 differs in the indexer's RoPE layout only, which the parity
# test covers (tests/megatron/test_dsa_parity.py). (tp, pp, ep, etp, mbs), packed rows:
KINDS = ("deepseek_v32",)
LAYOUTS = [((1, 1, 1, 1, 2), False), ((1, 2, 2, 1, 2), True)]
LP_TOL = 1e-5  # fp32 log-probs of logits whose fp32 error is ~1e-6 (tests/megatron/test_dsa_parity.py)
GRAD_TOL = 1e-5  # per tensor, relative to its max: fp32 gradients of sums of a few hundred terms (~1e-6)
MIN_GAP = 1e-4  # tests/megatron/test_dsa_parity.py
CAUSAL_LM = "AutoModelForCausalLM"  # the DSA checkpoints' class (Qwen3.5's are vision-language ones)


def test_dsa_actor_matches_transformers_autograd_in_every_layout(tmp_path):
    from safetensors.torch import load_file

    from tests.helpers.tiny_dsa import make_tiny_dsa_hf, reference
    from tests.workers.batches import portable, tensors

    paths = {k: str(make_tiny_dsa_hf(tmp_path / k, k, seed=5 + i)) for i, k in enumerate(KINDS)}
    batches = {k: _batch(p, CAUSAL_LM) for k, p in paths.items()}
    for k, b in batches.items():  # the selection of every sample is stable under float32 rounding
        am = b.attention_mask.bool()
        gaps = [r["gap"] for r in reference(paths[k], [b.input_ids[i][am[i]][None] for i in range(len(am))])]
        assert min(gaps) >= MIN_GAP, (k, min(gaps))
    layouts = {k: LAYOUTS for k in paths}
    res = tensors(run_ranks(_rank, 4, args=(paths, portable(batches), layouts), timeout_s=560))
    report, failures = [], []
    for k, path in paths.items():
        ref_lp, ref_loss, ref_g = _reference(path, batches[k], CAUSAL_LM)
        ckpt = load_file(str(tmp_path / k / "model.safetensors"))
        indexer = [n for n in ckpt if ".self_attn.indexer." in n]
        for li, (lay, packed) in enumerate(LAYOUTS):
            tag = f"{k} {lay} packed={packed}"
            d_lp = max(float((r[k][li]["lp"] - ref_lp).abs().max()) for r in res)
            d_loss = max(abs(r[k][li]["loss"] - ref_loss) for r in res)
            grads = _step_grads([r[k][li] for r in res], ckpt)
            assert len(indexer) == 20 and all(not grads[n].any() for n in indexer), tag  # the indexer did not move
            missing = {n for n, g in ref_g.items() if float(g.abs().max()) > 0} - set(grads)
            assert not missing, (tag, sorted(missing)[:5])
            rel = {n: float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12)
                   for n, g in ref_g.items() if float(g.abs().max()) > 1e-9}
            worst = max(rel, key=rel.get)
            report.append(f"{tag}: |lp - hf| {d_lp:.2e}, |loss - hf| {d_loss:.2e}, grad max rel {rel[worst]:.2e} "
                          f"({worst})")
            if d_lp > LP_TOL:
                failures.append(f"{tag}: log-probs {d_lp:.3g} from transformers'")
            if d_loss > 1e-6 * max(1.0, abs(ref_loss)):
                failures.append(f"{tag}: loss {d_loss:.3g} from transformers' autograd loss {ref_loss:.6f}")
            if rel[worst] > GRAD_TOL:
                failures.append(f"{tag}: gradient {worst} {rel[worst]:.3g} from transformers' autograd")
        assert not any(".indexer." in n for n in ref_g) and any("kv_b_proj" in n for n in ref_g), k
    print("\n".join(report), f"(lr {LR}, eps {EPS})")
    assert not failures, "\n".join(failures)

