"""LoRA actor at TP2×PP2 (DistributedOptimizer): only adapters train and hold optimizer state, the
reference is the base model exactly, checkpoints resume exactly (also resharded to TP1×PP1 on packed rows:
same log-probs, gradient norm and next step as the padded TP2×PP2 run), and the PEFT export (loaded by
``peft`` onto the HF base) and the merged HF export reproduce the actor's log-probs."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multirank, pytest.mark.timeout(900)]
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"]}


def _cfg(tp, pp, lora=LORA):
    from mrl.config.actor import ActorConfig

    return ActorConfig(
        megatron={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        ppo_micro_batch_size_per_gpu=2, use_distributed_optimizer=True, lora=lora,
        optim={"lr": 5e-2, "eps": 1e-2, "lr_schedule": "cosine", "clip_grad": 1.0},
    )


def _rank(rank, world, path, ckpt, peft_dir, hf_out):
    import torch.distributed as dist

    from mrl.megatron.lora import adapters_of, export_peft_tensors
    from mrl.megatron.lora_io import read_lora_meta, write_peft
    from mrl.workers.actor import ActorWorker
    from mrl.workers.reference import ColocatedReference
    from tests.workers.batches import portable, ragged_batch

    a_batch, b_batch = ragged_batch(seed=1), ragged_batch(seed=2)
    out = {}
    base = ActorWorker(_cfg(2, 2, lora={}), model_path=path, mini_batch_size_samples=8, total_optimizer_steps=4, seed=1234)
    out["lp_base"] = base.compute_log_prob(b_batch)[0]
    del base
    actor = ActorWorker(_cfg(2, 2), model_path=path, mini_batch_size_samples=8, total_optimizer_steps=4, seed=1234)
    ref = ColocatedReference(actor)
    out["ref_host_copy"] = ref.host is not None
    out["lp0"] = actor.compute_log_prob(b_batch)[0]  # B = 0: the policy starts as the base model
    params = {n: p.detach().clone() for c in actor.model.chunks for n, p in c.named_parameters()}
    trainable = [n for c in actor.model.chunks for n, p in c.named_parameters() if p.requires_grad]
    opt_numel = sum(p.numel() for g in actor.optimizer.param_groups for p in g["params"])
    adapter_numel = sum(p.numel() for a in adapters_of(actor.model.chunks) for p in a.parameters())
    out["numel"] = (opt_numel, adapter_numel, sum(p.numel() for p in params.values()))
    out["trainable_not_lora"] = [n for n in trainable if "_lora." not in n]
    out["m1"] = actor.update_policy(a_batch)
    changed = {n for c in actor.model.chunks for n, p in c.named_parameters() if not torch.equal(p, params[n])}
    out["changed_not_lora"] = sorted(n for n in changed if "_lora." not in n)
    out["changed_lora"] = len([n for n in changed if "_lora." in n])
    out["lp1"] = actor.compute_log_prob(b_batch)[0]
    out["ref1"] = ref.compute_ref_log_prob(b_batch)
    out["lp1_after_ref"] = actor.compute_log_prob(b_batch)[0]
    actor.save_checkpoint(ckpt, ["model", "optimizer", "extra"])
    out["meta"] = read_lora_meta(ckpt)
    out["m2"] = actor.update_policy(b_batch)
    out["lp2"] = actor.compute_log_prob(b_batch)[0]
    peft = dict(export_peft_tensors(actor.model.chunks))
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: v for k, v in peft.items()})
    if rank == 0:
        merged = {k: v for d in gathered for k, v in d.items()}
        write_peft(peft_dir, merged, out["meta"], base_model=path)
    actor.export_hf(hf_out)
    del actor, ref

    resumed = ActorWorker(_cfg(2, 2), model_path=path, mini_batch_size_samples=8, total_optimizer_steps=4, seed=1234)
    resumed.load_checkpoint(ckpt, ["model", "optimizer", "extra"])
    out["lp1_loaded"] = resumed.compute_log_prob(b_batch)[0]
    out["m2_resumed"] = resumed.update_policy(b_batch)
    out["lp2_resumed"] = resumed.compute_log_prob(b_batch)[0]
    del resumed

    # resharded: TP1×PP1 (DP4) loads the TP2×PP2 adapters and their Adam state, on packed rows (use_remove_padding)
    flat = ActorWorker(_cfg(1, 1), model_path=path, mini_batch_size_samples=8, total_optimizer_steps=4, seed=1234,
                       remove_padding=True)
    flat.load_checkpoint(ckpt, ["model", "optimizer", "extra"])
    out["lp1_flat"] = flat.compute_log_prob(b_batch)[0]
    out["m2_flat"] = flat.update_policy(b_batch)
    out["lp2_flat"] = flat.compute_log_prob(b_batch)[0]
    return portable(out)


def test_lora_actor_tp2pp2(tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from tests.workers.batches import ragged_batch, tensors
    from tests.workers.reference_impl import hf_log_probs

    path = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    dirs = [str(tmp_path / d) for d in ("ckpt", "peft", "hf")]
    res = tensors(run_ranks(_rank, 4, args=(str(path), *dirs), timeout_s=840))
    r = res[0]
    opt_numel, adapter_numel, all_numel = r["numel"]
    print(f"optimizer holds {opt_numel} params = adapters {adapter_numel} of {all_numel} on this rank")
    assert opt_numel == adapter_numel and adapter_numel < all_numel / 10
    assert r["trainable_not_lora"] == [] and r["changed_not_lora"] == [] and r["changed_lora"] > 0
    assert r["ref_host_copy"] is False  # no reference copy: the adapters are switched off
    for x in res:
        assert torch.equal(x["lp0"], x["lp_base"])  # B = 0 at start
        assert torch.equal(x["ref1"], x["lp_base"])  # reference = base model, exactly
        assert torch.equal(x["lp1_after_ref"], x["lp1"])  # adapters back on after the reference pass
        assert float((x["lp1"] - x["lp_base"]).abs().max()) > 1e-3  # the update moved the policy
        torch.testing.assert_close(x["lp1_loaded"], x["lp1"], rtol=0, atol=1e-6)
        assert x["m2_resumed"]["actor/grad_norm"] == pytest.approx(x["m2"]["actor/grad_norm"], rel=1e-5)
        assert x["m2_resumed"]["actor/lr"] == pytest.approx(x["m2"]["actor/lr"], rel=1e-12)
        torch.testing.assert_close(x["lp2_resumed"], x["lp2"], rtol=0, atol=1e-5)
        torch.testing.assert_close(x["lp1_flat"], x["lp1"], rtol=0, atol=1e-5)
        assert x["m2_flat"]["actor/grad_norm"] == pytest.approx(x["m2"]["actor/grad_norm"], rel=1e-5)
        torch.testing.assert_close(x["lp2_flat"], x["lp2"], rtol=0, atol=1e-5)
    assert r["meta"]["rank"] == 4 and len(r["meta"]["targets"]) == 7
    print("resume: max |Δ lp2| same layout", float((r["lp2_resumed"] - r["lp2"]).abs().max()),
          "TP1xPP1", float((r["lp2_flat"] - r["lp2"]).abs().max()))
    b = ragged_batch(seed=2)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(model, dirs[1]).eval()
    with torch.no_grad():
        lp_peft, _ = hf_log_probs(pm, b)
    merged = AutoModelForCausalLM.from_pretrained(dirs[2], dtype=torch.float32).eval()
    with torch.no_grad():
        lp_merged, _ = hf_log_probs(merged, b)
    d_peft = float((lp_peft - r["lp2"]).abs().max())
    d_merged = float((lp_merged - r["lp2"]).abs().max())
    print(f"peft export vs actor: {d_peft:.2e}; merged HF export vs actor: {d_merged:.2e}")
    assert d_peft <= 1e-5 and d_merged <= 1e-5

    # mrl-ckpt on the step-1 checkpoint (TP2×PP2, loaded at TP1): the adapter alone in peft's format, and
    # the merged model; both reproduce the actor's log-probs at that checkpoint.
    from checkpoints_tools.cli import main as ckpt_main

    peft_out, hf_merged = tmp_path / "ckpt_peft", tmp_path / "ckpt_merged"
    assert ckpt_main(["mcore-to-peft", "--mcore", dirs[0], "--out", str(peft_out), "--device", "cpu"]) == 0
    assert sorted(p.name for p in peft_out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert ckpt_main(["mcore-to-hf", "--mcore", dirs[0], "--out", str(hf_merged), "--device", "cpu"]) == 0
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, str(peft_out)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(hf_merged), dtype=torch.float32).eval()
    with torch.no_grad():
        d_ckpt_peft = float((hf_log_probs(pm, b)[0] - r["lp1"]).abs().max())
        d_ckpt_merged = float((hf_log_probs(merged, b)[0] - r["lp1"]).abs().max())
    print(f"mrl-ckpt mcore-to-peft vs actor: {d_ckpt_peft:.2e}; mcore-to-hf (merged) vs actor: {d_ckpt_merged:.2e}")
    assert d_ckpt_peft <= 1e-5 and d_ckpt_merged <= 1e-5

    # reshard (TP2×PP2 -> TP1×PP2) keeps the adapters and lora_config.json: the same peft tensors come out
    from safetensors.torch import load_file

    resharded, peft_rs = tmp_path / "ckpt_rs", tmp_path / "ckpt_rs_peft"
    assert ckpt_main(["reshard", "--in", dirs[0], "--out", str(resharded), "--tp", "1", "--pp", "2",
                      "--device", "cpu"]) == 0
    assert ckpt_main(["mcore-to-peft", "--mcore", str(resharded), "--out", str(peft_rs), "--device", "cpu"]) == 0
    a, b2 = load_file(str(peft_out / "adapter_model.safetensors")), load_file(str(peft_rs / "adapter_model.safetensors"))
    assert a.keys() == b2.keys() and all(torch.equal(a[k], b2[k]) for k in a)
