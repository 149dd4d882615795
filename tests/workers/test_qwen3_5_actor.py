"""Qwen3.5 (dense and MoE, the released vision-language checkpoint form) through the actor: log-probs equal
transformers', and one update's loss and gradients equal an independent autograd computation through transformers
and do not depend on the layout (dense: DP4 on padded rows, TP2 (DP2) on packed rows, PP2 (DP2) on packed rows with
a stage boundary between a linear and a full-attention layer; MoE: DP4 padded, EP2 packed, EP2 × PP2 packed).

The batch's ``old_log_probs`` are transformers' own log-probs of the responses, so the PPO ratio is 1 (clipping
inactive) and, with no entropy or KL term, the loss is ``L = −Σ_t A_t r_t / N`` over the mini-batch's N valid response
tokens (token-mean): ``∂L/∂θ = −Σ_t A_t ∂log π(t)/∂θ / N``, computed here by autograd through transformers
(``hf_padded_log_probs``: its own padded forward, no mrl input builder), with the MoE router's aux loss off. The
update's gradient is read back from one Adam step (tests/workers/test_moe_families_actor.py explains how: lr 1e4,
eps 1, ``g = eps·y / (1 − |y|)``). A ×2 on the policy gradient, a packed row whose Gated DeltaNet state runs across
sequences, or a response token scored from the wrong column all fail here."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.workers.test_moe_families_actor import (
    EPS,
    LR,
    _cfg,
    _one_update,
    _step_grads,
)

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]

VOCAB = 96
LAYOUTS = {  # (tp, pp, ep, etp, micro-batch size), packed rows
    "dense": [((1, 1, 1, 1, 2), False), ((2, 1, 1, 1, 2), True), ((1, 2, 1, 1, 2), True)],
    "moe": [((1, 1, 1, 1, 2), False), ((1, 1, 2, 1, 2), True), ((1, 2, 2, 1, 2), True)],
}
LP_TOL = 1e-5  # fp32 log-probs (a softmax of logits whose fp32 error is ~1e-5: tests/megatron/test_qwen3_5_parity.py)
# per tensor, relative to its max: fp32 gradients through the delta rule's solves (the forward's own fp32 error is
# ~4e-6 of the logits, tests/megatron/test_qwen3_5_parity.py); measured <= 8e-6
GRAD_TOL = 5e-5


def _hf_model(path, auto: str):
    """The checkpoint in transformers, fp32, eager experts; ``auto``: its Auto class (the released Qwen3.5 checkpoints
    are vision-language ones, the DSA checkpoints of tests/workers/test_dsa_actor.py causal LMs)."""
    import transformers as tf

    return getattr(tf, auto).from_pretrained(path, dtype=torch.float32, experts_implementation="eager")


def _batch(path, auto: str = "AutoModelForImageTextToText"):
    """ragged_batch with old_log_probs = transformers' log-probs of its responses under the checkpoint (ratio 1)."""
    from tests.workers.batches import ragged_batch
    from tests.workers.reference_impl import hf_padded_log_probs

    batch = ragged_batch(vocab=VOCAB, with_ref=False)
    model = _hf_model(path, auto)
    with torch.no_grad():
        batch.old_log_probs = hf_padded_log_probs(model.eval(), batch)[0]
    return batch


def _rank(rank, world, paths, batches, layouts=LAYOUTS):
    from tests.workers.batches import portable, tensors

    batches = tensors(batches)
    return portable({fam: [_one_update(paths[fam], _cfg(*lay), packed, batches[fam]) for lay, packed in layouts[fam]]
                     for fam in paths})


def _reference(path, batch, auto: str = "AutoModelForImageTextToText"):
    """(log-probs [B, R], loss, {hf name: ∂L/∂θ}) by autograd through transformers (module docstring)."""
    from tests.workers.reference_impl import hf_padded_log_probs

    model = _hf_model(path, auto)
    model.eval()
    lp, _ = hf_padded_log_probs(model, batch)
    mask = batch.response_mask.bool()
    ratio = torch.exp(lp - batch.old_log_probs)  # 1, with the gradient of log π
    loss = -(batch.advantages * ratio)[mask].sum() / mask.sum()
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is None:  # the vision tower: not on the text path
            continue
        g = p.grad.detach().double()
        if n.endswith("mlp.experts.gate_up_proj"):  # transformers holds the experts fused: [E, 2F, H] = [gate; up]
            for e, ge in enumerate(g):
                f = ge.shape[0] // 2
                grads[n.replace("gate_up_proj", f"{e}.gate_proj.weight")] = ge[:f]
                grads[n.replace("gate_up_proj", f"{e}.up_proj.weight")] = ge[f:]
        elif n.endswith("mlp.experts.down_proj"):  # [E, H, F]
            for e, ge in enumerate(g):
                grads[n.replace("down_proj", f"{e}.down_proj.weight")] = ge
        else:
            grads[n] = g
    return lp.detach(), float(loss), grads


def test_qwen3_5_actor_matches_transformers_autograd_in_every_layout(tmp_path):
    from safetensors.torch import load_file

    from tests.helpers.tiny_qwen3_5 import make_tiny_qwen3_5_hf
    from tests.workers.batches import portable, tensors

    paths = {"dense": str(make_tiny_qwen3_5_hf(tmp_path / "dense", seed=3)),
             "moe": str(make_tiny_qwen3_5_hf(tmp_path / "moe", moe=True, seed=4))}
    batches = {fam: _batch(path) for fam, path in paths.items()}
    res = tensors(run_ranks(_rank, 4, args=(paths, portable(batches)), timeout_s=560))
    report, failures = [], []
    for fam, path in paths.items():
        ref_lp, ref_loss, ref_g = _reference(path, batches[fam])
        ckpt = load_file(str(tmp_path / fam / "model.safetensors"))
        for li, (lay, packed) in enumerate(LAYOUTS[fam]):
            tag = f"{fam} {lay} packed={packed}"
            d_lp = max(float((r[fam][li]["lp"] - ref_lp).abs().max()) for r in res)
            d_loss = max(abs(r[fam][li]["loss"] - ref_loss) for r in res)
            grads = _step_grads([r[fam][li] for r in res], ckpt)
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
        # the check has power: the Gated DeltaNet and gated-attention parameters all received a gradient
        assert any("linear_attn.A_log" in n for n in ref_g) and any("self_attn.q_proj" in n for n in ref_g), fam
    print("\n".join(report), f"(lr {LR}, eps {EPS})")
    assert not failures, "\n".join(failures)
