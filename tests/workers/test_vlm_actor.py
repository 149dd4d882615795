"""Qwen2.5-VL, Qwen3-VL (interleaved mRoPE, deepstack) and Qwen3-VL-MoE through the actor (vision tower on the first stage, pictures in ``TrainBatch.multi_modal``): log-probs
equal transformers', and one update's loss and gradients equal an independent autograd computation through
transformers in every layout — DP2 on padded rows (one sample per micro-batch), TP2 on packed rows, PP2 on packed
rows (the tower on stage 0, its gradient through the pipeline) — with the tower frozen (``actor.freeze_vision_tower``,
the default: its weights unchanged, outside DDP's buffers and the optimizer) and trained (TP2 packed: its gradient
equals transformers' too); Qwen3-VL in three of those layouts (DP2 padded frozen, TP2 packed trained, PP2 packed
frozen); Qwen3-VL-MoE at EP2 on packed rows, tower frozen, routing replay R2 (``old``: recorded in the old-log-prob
forward, replayed in the update; its experts' gradients compared in the checkpoint's ``x @ W`` layout); Qwen3.5 (Gated
DeltaNet + gated attention, interleaved mRoPE on a quarter of each head) at TP2 packed frozen.

Objective (as tests/workers/test_qwen3_5_actor.py): ``old_log_probs`` are transformers' fp32 log-probs, so the PPO
ratio is 1, and with no entropy/KL term ``L = −Σ_t A_t r_t / N`` (token-mean over the batch's N response tokens);
transformers' autograd of it (float64) is the reference. The update's gradient is read back from its one Adam step
(lr 1e4, eps 1: ``g = eps·y / (1 − |y|)``, ``y = (w_before − w_after) / lr``; tests/workers/test_moe_families_actor.py).
Bounds: log-probs 1e-5 (fp32 logits within 3e-7 of float64: tests/megatron/test_vlm_parity.py); gradients per tensor
1e-5 of its largest entry (fp32 sums of a 2-layer model, ~1e3 terms: ~u·√K·depth ≈ 1e-6, measured below that); Qwen3.5's
5e-5 (its Gated DeltaNet gradient, tests/workers/test_qwen3_5_actor.py; measured 6e-6)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(600)]

LR, EPS = 1e4, 1.0
LP_TOL, GRAD_TOL = 1e-5, 1e-5
# Qwen3.5's gradients pass through the delta rule's triangular solves: tests/workers/test_qwen3_5_actor.py's bound
KIND_GRAD_TOL = {"qwen3_5": 5e-5}
# (tp, pp, micro-batch size), packed rows, tower frozen
LAYOUTS = {"qwen2_5_vl": [((1, 1, 1), False, True), ((2, 1, 2), True, True), ((1, 2, 2), True, True),
                          ((2, 1, 2), True, False)],
           "qwen3_vl": [((1, 1, 1), False, True), ((2, 1, 2), True, False), ((1, 2, 2), True, True)],
           "qwen3_vl_moe": [((1, 1, 2), True, True)], "qwen3_5": [((2, 1, 2), True, True)]}
EP = {"qwen3_vl_moe": 2}  # expert-parallel size per kind (Qwen3-VL-MoE: its 4 experts over both ranks)
# routing replay per kind: R2, the recipe's (the update replays the old-log-prob forward's routing of the same
# weights, so the gradient is still transformers')
REPLAY = {"qwen3_vl_moe": "old"}


def _one_update(path, layout, packed, frozen, batch, ep=1, replay="none"):
    from megatron.core import parallel_state as ps

    from mrl.config.actor import ActorConfig
    from mrl.megatron.unwrap import unwrap
    from mrl.workers.actor import ActorWorker

    (tp, pp, mbs) = layout
    cfg = ActorConfig(megatron={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                "expert_model_parallel_size": ep}, moe={"routing_replay": replay},
                      ppo_micro_batch_size_per_gpu=mbs, freeze_vision_tower=frozen, loss_agg_mode="token-mean",
                      optim={"lr": LR, "eps": EPS, "weight_decay": 0.0, "clip_grad": 0.0})
    actor = ActorWorker(cfg, model_path=path, mini_batch_size_samples=batch.batch_size, seed=1234,
                        remove_padding=packed, attention_backend="sdpa")
    towers = [t for c in actor.model.chunks if (t := getattr(unwrap(c), "vision_model", None)) is not None]
    # frozen: no gradient, no DDP buffer (Megatron's optimizer is built from those buffers)
    in_ddp = [hasattr(p, "main_grad") for t in towers for p in t.parameters()]
    lp, _ = actor.compute_log_prob(batch)
    recorded = actor.records_routing and actor.old_routing is not None
    metrics = actor.update_policy(batch)
    replayed = recorded and actor.old_routing is None  # the update took the record (one update per recording)
    keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    weights = {n: t.clone() for n, t in actor.export_hf_weights()}
    del actor
    return {"lp": lp, "loss": metrics["actor/pg_loss"], "weights": weights if keep else None,
            "tower_in_ddp": in_ddp, "has_tower": bool(towers), "replayed": replayed}


def _rank(rank, world, paths, batches):
    from tests.workers.batches import portable, tensors

    batches = tensors(batches)
    return portable({k: [_one_update(paths[k], *lay, batches[k], ep=EP.get(k, 1), replay=REPLAY.get(k, "none"))
                         for lay in LAYOUTS[k]]
                     for k in paths})


def _hf_log_probs(model, batch):
    """[B, R] log-probs of the responses from transformers' per-sample forward with the pictures."""
    from tests.helpers.tiny_vlm import hf_vlm_logits

    logits = hf_vlm_logits(model, batch)
    B, R = batch.responses.shape
    P = batch.prompt_length
    out = torch.zeros(B, R, dtype=logits[0].dtype)
    for i, lg in enumerate(logits):
        p = int(batch.attention_mask[i, :P].sum())
        r = int(batch.attention_mask[i, P:].sum())
        lsm = torch.log_softmax(lg[p - 1:p + r - 1], -1)
        out[i, :r] = lsm.gather(-1, batch.responses[i, :r, None])[:, 0]
    return out


def _reference(path, batch):
    """(log-probs, loss, {checkpoint name: ∂L/∂θ}) by float64 autograd through transformers (module docstring);
    Qwen2.5-VL's checkpoint keeps the released names (``model.layers.*``, ``visual.*``), transformers' modules are
    ``model.language_model.*`` / ``model.visual.*``."""
    from transformers import AutoModelForImageTextToText

    # eager experts: transformers' grouped-GEMM path has no float64 kernel
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").eval()
    released = model.config.model_type == "qwen2_5_vl"
    xw = model.config.model_type == "qwen3_vl_moe"  # its checkpoint's fused experts: the modules' transposes
    lp = _hf_log_probs(model, batch)
    mask = batch.response_mask.bool()
    loss = -(batch.advantages.double() * torch.exp(lp - lp.detach()))[mask].sum() / mask.sum()
    loss.backward()
    def rename(n: str) -> str:
        return n.replace("model.language_model.", "model.").replace("model.visual.", "visual.") if released else n

    def as_saved(n: str, g: torch.Tensor) -> torch.Tensor:
        return g.transpose(1, 2) if xw and ".mlp.experts." in n else g

    grads = {rename(n): as_saved(n, p.grad.detach()) for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), float(loss.detach()), grads


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from tests.helpers.tiny_vlm import save_tiny_vlm, vlm_batch
    from tests.workers.batches import portable, tensors

    root = tmp_path_factory.mktemp("vlm_actor")
    paths, batches = {}, {}
    for i, kind in enumerate(LAYOUTS):
        paths[kind] = str(save_tiny_vlm(root / kind, kind, seed=5 + i))
        batch = vlm_batch(paths[kind], seed=1)
        with torch.no_grad():
            batch.old_log_probs = _hf_log_probs(AutoModelForImageTextToText.from_pretrained(
                paths[kind], dtype=torch.float32).eval(), batch).float()
        batches[kind] = batch
    res = tensors(run_ranks(_rank, 2, args=(paths, portable(batches)), timeout_s=560))
    return root, paths, batches, res


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_vlm_actor_matches_transformers_autograd_in_every_layout(launched, kind):
    from safetensors.torch import load_file

    root, paths, batches, res = launched
    batch = batches[kind]
    ref_lp, ref_loss, ref_g = _reference(paths[kind], batch)
    ckpt = load_file(str(root / kind / "model.safetensors"))
    prefix = "visual." if kind == "qwen2_5_vl" else "model.visual."
    assert any(n.startswith(prefix) for n in ref_g) and any(".self_attn.q_proj" in n for n in ref_g)
    report, failures = [], []
    for li, (lay, packed, frozen) in enumerate(LAYOUTS[kind]):
        tag = f"{kind} tp{lay[0]}pp{lay[1]}ep{EP.get(kind, 1)} packed={packed} frozen={frozen}"
        runs = [r[kind][li] for r in res]
        d_lp = max(float((r["lp"] - ref_lp).abs().max()) for r in runs)
        d_loss = max(abs(float(r["loss"]) - ref_loss) for r in runs)
        assert all(r["replayed"] is (REPLAY.get(kind, "none") == "old") for r in runs), tag
        assert any(r["has_tower"] for r in runs) and all(not r["has_tower"] for r in runs[1:] if lay[1] == 2)
        assert all(all(not x for x in r["tower_in_ddp"]) if frozen else all(r["tower_in_ddp"]) for r in runs), tag
        weights = {n: w for r in runs for n, w in (r["weights"] or {}).items()}
        assert set(weights) == set(ckpt), tag
        grads = {}
        for n, w in weights.items():
            y = (ckpt[n].double() - w.double()) / LR
            grads[n] = EPS * y / (1 - y.abs())
        rel = {}
        for n, g in ref_g.items():
            if frozen and n.startswith(prefix):
                assert torch.equal(weights[n], ckpt[n]), f"{tag}: frozen tower tensor {n} moved"
                continue
            rel[n] = float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-12)
        worst = max(rel, key=rel.get)
        report.append(f"{tag}: |lp - hf| {d_lp:.2e}, |loss - hf| {d_loss:.2e}, grad max rel {rel[worst]:.2e} ({worst})")
        if d_lp > LP_TOL:
            failures.append(f"{tag}: log-probs {d_lp:.3g} from transformers'")
        if d_loss > 1e-6 * max(1.0, abs(ref_loss)):
            failures.append(f"{tag}: loss {d_loss:.3g} from transformers' {ref_loss:.6f}")
        if rel[worst] > KIND_GRAD_TOL.get(kind, GRAD_TOL):
            failures.append(f"{tag}: gradient {worst} {rel[worst]:.3g} from transformers' autograd")
    print("\n".join(report), f"(lr {LR}, eps {EPS})")
    assert not failures, "\n".join(failures)
