"""mrl.megatron.checkpoint: dist_checkpointing save/load across layouts, with optimizer state.

* Weights saved at TP2×PP2 load at TP1×PP1 (DP4) and export bit-identical HF tensors; the save starts
  no spawned Manager process (mrl.megatron.checkpoint._in_process_write_results). So do weights saved at
  PP2 with uneven stages (num_layers_in_first_pipeline_stage=1: layer 0 alone on stage 0).
* Model + DistributedOptimizer + scheduler saved after one Adam step at TP2 and loaded at
  TP1×DP2 continue training exactly as the uninterrupted run (|Δw| ≤ 1e-6 after step 2), while
  a run that loads the weights only lands measurably elsewhere (the test can fail).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf

pytestmark = pytest.mark.multirank


def _layout_rank(rank: int, world: int, hf_dir: str, ckpt_dir: str) -> dict:
    from mrl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.parallel import init_parallel
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    cfg = load_hf_config(hf_dir)
    ref = _hf_tensors(hf_dir).__getitem__
    init_parallel(device="cpu", tp=2, pp=2)
    chunks = build_model_chunks(cfg)
    load_hf_weights(chunks, cfg, ref)
    spawned = _count_spawned_managers()
    save_checkpoint(ckpt_dir, chunks, extra={"step": 7, "tag": "rl"}, hf_config=cfg)

    init_parallel(device="cpu", tp=1, pp=1)  # DP=4: every rank loads the whole model
    chunks = build_model_chunks(cfg)
    differs_before = [n for n, t in export_hf_weights(chunks, cfg) if not torch.equal(t, ref(n))]
    extra = load_checkpoint(ckpt_dir, chunks)
    exported = dict(export_hf_weights(chunks, cfg))
    bad = [n for n, t in exported.items() if t.dtype != ref(n).dtype or not torch.equal(t, ref(n))]

    # uneven pipeline stages (layer 0 alone on stage 0, layers 1-3 on stage 1): saved, then loaded at PP1
    uneven = {"num_layers_in_first_pipeline_stage": 1}
    init_parallel(device="cpu", tp=1, pp=2)
    chunks = build_model_chunks(cfg, config_overrides=uneven)
    stage_layers = [m.layer_number for m in chunks[0].decoder.layers]
    load_hf_weights(chunks, cfg, ref)
    save_checkpoint(f"{ckpt_dir}_uneven", chunks, hf_config=cfg)
    init_parallel(device="cpu", tp=1, pp=1)
    chunks = build_model_chunks(cfg)
    load_checkpoint(f"{ckpt_dir}_uneven", chunks)
    bad_uneven = [n for n, t in export_hf_weights(chunks, cfg) if not torch.equal(t, ref(n))]
    return {"extra": extra, "bad": bad, "n": len(exported), "differs_before": len(differs_before),
            "spawned_managers": len(spawned), "stage_layers": stage_layers, "bad_uneven": bad_uneven}


def _count_spawned_managers() -> list:
    """Records each ``multiprocessing`` Manager started from a spawn context in this process (one entry
    each): Megatron's writer makes one on a rank's first save unless mrl hands it an in-process queue."""
    import multiprocessing.context as mpc

    calls: list = []
    base = mpc.BaseContext.Manager

    def manager(self, *args, **kwargs):
        calls.append(1)
        return base(self, *args, **kwargs)

    mpc.SpawnContext.Manager = manager
    return calls


def test_save_tp2pp2_load_tp1pp1_exports_identical_weights(tmp_path: Path) -> None:
    hf = make_tiny_hf(tmp_path / "hf", "qwen2")
    ckpt = tmp_path / "ckpt"
    results = run_ranks(_layout_rank, world_size=4, args=(str(hf), str(ckpt)), timeout_s=400)
    for r in results:
        assert r["extra"] == {"step": 7, "tag": "rl"}
        assert r["n"] == len(_hf_tensors(hf)) and r["bad"] == []
        assert r["differs_before"] > 0  # random init really was replaced by the checkpoint
        assert r["spawned_managers"] == 0  # the synchronous save started no Manager interpreter
        assert r["bad_uneven"] == []  # a checkpoint of uneven stages is layout-independent too
    assert sorted(r["stage_layers"] for r in results) == [[1], [1], [2, 3, 4], [2, 3, 4]]
    meta = json.loads((ckpt / "mrl_checkpoint.json").read_text())
    assert meta["layout"]["tp"] == 2 and meta["layout"]["pp"] == 2 and meta["layout"]["world_size"] == 4
    assert meta["hf_config"]["vocab_size"] == 300 and meta["params_dtype"] == "float32"
    assert meta["has_optimizer"] is False


def _hf_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(hf_dir) / "model.safetensors"))


LR = 0.05


def _train_setup(hf_dir: str):
    from megatron.core.distributed import (
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from mrl.megatron.mapping import load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    cfg = load_hf_config(hf_dir)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    chunks = build_model_chunks(cfg, wrap_ddp=True, ddp_config=ddp)
    load_hf_weights(chunks, cfg, _hf_tensors(hf_dir).__getitem__)
    chunks[0].module.config.finalize_model_grads_func = finalize_model_grads
    # adam_eps=1 keeps the update a smooth function of the gradient (no sign flips from fp noise).
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, adam_eps=1.0, weight_decay=0.0,
                        use_distributed_optimizer=True, clip_grad=1e9), chunks)
    sched = OptimizerParamScheduler(
        opt, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=100, wd_incr_style="constant")
    return cfg, chunks, opt, sched


def _adam_step(cfg, chunks, opt, sched, seed: int) -> None:
    """One step on the same 2×8-token batch on every DP rank (so DP size does not change it)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    pos = torch.arange(8).expand(2, 8)

    def step(data_iter, model):
        b = next(data_iter)
        # Vocab-parallel logits [B, T, V_pad/TP] → full [B, T, V] (the gather's backward splits).
        logits = gather_from_tensor_model_parallel_region(model(b[:, :-1], pos, None))[..., : cfg.vocab_size]

        def loss_func(out):
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), b[:, 1:].reshape(-1))
            return loss, {"loss": loss.detach()}

        return logits, loss_func

    for c in chunks:
        c.train()
        c.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([batch]), model=chunks,
                                num_microbatches=1, seq_length=8, micro_batch_size=2, forward_only=False)
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=1)


def _optim_rank(rank: int, world: int, hf_dir: str, ckpt_dir: str) -> dict:
    from mrl.megatron.checkpoint import load_checkpoint, save_checkpoint
    from mrl.megatron.mapping import export_hf_weights
    from mrl.megatron.parallel import init_parallel

    init_parallel(device="cpu", tp=2)
    cfg, chunks, opt, sched = _train_setup(hf_dir)
    _adam_step(cfg, chunks, opt, sched, seed=1)
    save_checkpoint(ckpt_dir, chunks, opt, sched, extra={"step": 1}, hf_config=cfg)
    _adam_step(cfg, chunks, opt, sched, seed=2)
    ref = dict(export_hf_weights(chunks, cfg))

    init_parallel(device="cpu", tp=1)  # DP=2: optimizer state resharded over TP and DP
    cfg, chunks, opt, sched = _train_setup(hf_dir)
    extra = load_checkpoint(ckpt_dir, chunks, opt, sched)
    steps_loaded = sched.num_steps
    _adam_step(cfg, chunks, opt, sched, seed=2)
    resumed = max((t - ref[n]).abs().max().item() for n, t in export_hf_weights(chunks, cfg))

    cfg, chunks, opt, sched = _train_setup(hf_dir)
    load_checkpoint(ckpt_dir, chunks, opt, load_optimizer=False)  # weights only, fresh Adam
    _adam_step(cfg, chunks, opt, sched, seed=2)
    fresh = max((t - ref[n]).abs().max().item() for n, t in export_hf_weights(chunks, cfg))
    return {"extra": extra, "steps": steps_loaded, "resumed": resumed, "fresh": fresh}


def test_optimizer_and_scheduler_state_resume_across_layouts(tmp_path: Path) -> None:
    hf = make_tiny_hf(tmp_path / "hf", "llama")
    ckpt = tmp_path / "ckpt"
    results = run_ranks(_optim_rank, world_size=2, args=(str(hf), str(ckpt)), timeout_s=400)
    for r in results:
        assert r["extra"] == {"step": 1} and r["steps"] == 1
        assert r["resumed"] <= 1e-6, r
        assert r["fresh"] > 1e-4, r  # without the Adam moments step 2 goes elsewhere
    meta = json.loads((ckpt / "mrl_checkpoint.json").read_text())
    assert meta["has_optimizer"] and meta["optim_sharding"] == "fully_reshardable"


def test_clear_errors_for_absent_hf_and_corrupt_checkpoints(tmp_path: Path) -> None:
    from mrl.megatron.checkpoint import (
        CheckpointError,
        load_checkpoint,
        read_checkpoint_metadata,
    )

    hf = make_tiny_hf(tmp_path / "hf", "qwen2")
    with pytest.raises(CheckpointError, match="hf-to-mcore"):
        read_checkpoint_metadata(hf)  # an HF dir is pointed at the converter
    # These checks run before any collective, so no process group is needed.
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent", [])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "mrl_checkpoint.json").write_text(json.dumps({"has_optimizer": False}))
    with pytest.raises(CheckpointError, match="metadata.json is missing"):
        load_checkpoint(ckpt, [])
    for name in ("metadata.json", "common.pt", ".metadata"):
        (ckpt / name).write_bytes(b"")
    with pytest.raises(CheckpointError, match="cannot read the tensor index"):
        load_checkpoint(ckpt, [])
    (ckpt / "mrl_checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_checkpoint_metadata(ckpt)
