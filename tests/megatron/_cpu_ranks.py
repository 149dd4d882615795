"""Rank body for tests/megatron/test_cpu_support.py: one check per redirect, plus a real
DDP + DistributedOptimizer SGD step compared with transformers + torch autograd."""
from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _check_inactive_before() -> None:
    from mrl.megatron.cpu_support import cpu_support_active

    assert not cpu_support_active()


def _check_current_device() -> None:
    assert torch.cuda.current_device() == 0
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"


def _check_device_mode() -> None:
    for dev in ("cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0):
        for make in (lambda d: torch.empty(2, device=d), lambda d: torch.zeros(2, device=d),
                     lambda d: torch.tensor([1.0], device=d), lambda d: torch.arange(3, device=d)):
            assert make(dev).device.type == "cpu", dev
    x = torch.ones(2, dtype=torch.float32)
    assert x.to("cuda").device.type == "cpu"
    y = x.to(torch.cuda.current_device(), torch.float64)
    assert y.device.type == "cpu" and y.dtype == torch.float64
    assert torch.empty(2, pin_memory=True).device.type == "cpu"
    # A Megatron TP collective that allocates with device=torch.cuda.current_device().
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    part = torch.full((2, 3), float(ps.get_tensor_model_parallel_rank()))
    full = gather_from_tensor_model_parallel_region(part)
    assert full.shape == (2, 3 * ps.get_tensor_model_parallel_world_size())


def _check_tensor_cuda() -> None:
    x = torch.randn(3)
    assert x.cuda() is x and x.cuda(non_blocking=True) is x and x.pin_memory() is x


def _check_tensor_type() -> None:
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.zeros(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
    d = torch.zeros(1).type("torch.cuda.DoubleTensor")
    assert d.dtype == torch.float64 and d.device.type == "cpu"
    assert torch.zeros(1).type(torch.float64).dtype == torch.float64


def _check_rng_tracker() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    def draw():
        model_parallel_cuda_manual_seed(77)
        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            tp_draw = torch.rand(4)
        # Forking leaves the default stream where it was.
        assert torch.equal(before, torch.get_rng_state())
        return tp_draw

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("megatron.core.tensor_parallel.random").addHandler(handler)
    a, b = draw(), draw()
    assert not records, [r.getMessage() for r in records]
    assert torch.equal(a, b), "tensor-parallel RNG stream is not reproducible"
    gathered = [torch.empty(4) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(gathered, a, group=ps.get_tensor_model_parallel_group())
    if len(gathered) > 1:
        assert not torch.equal(gathered[0], gathered[1]), "TP ranks share a tensor-parallel RNG stream"
    st = get_cuda_rng_tracker().get_states()
    get_cuda_rng_tracker().set_states(st)


def _check_streams() -> None:
    s = torch.cuda.Stream(device=torch.cuda.current_device())
    s.wait_stream(torch.cuda.default_stream())
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.stream(s):
        x = torch.ones(2) * 2
    assert torch.cuda.synchronize() is None and x.sum().item() == 4.0


def _check_thread_local() -> None:
    from mrl.megatron.cpu_support import cpu_support_active, enable_cpu_support

    seen = {}

    def body():
        seen["before"] = cpu_support_active()
        enable_cpu_support()
        seen["after"] = cpu_support_active()
        seen["dev"] = torch.empty(1, device="cuda").device.type

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"before": False, "after": True, "dev": "cpu"}, seen
    enable_cpu_support()  # idempotent on this thread too
    from torch.overrides import _get_current_function_mode_stack

    from mrl.megatron.cpu_support import CpuDeviceMode

    assert sum(isinstance(m, CpuDeviceMode) for m in _get_current_function_mode_stack()) == 1


def _check_yarn_rope() -> None:
    """Redirect 10: MLA's YaRN rotary embedding builds (it passes no use_cpu_initialization) and gives the
    frequencies of its formula on CPU."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    yarn = YarnRotaryEmbedding(8, rotary_base=10000.0, scaling_factor=1.0, original_max_position_embeddings=16)
    emb, mscale = yarn(4)
    want = torch.outer(torch.arange(4.0), 1.0 / 10000.0 ** (torch.arange(0, 8, 2) / 8))  # factor 1: plain RoPE
    assert emb.device.type == "cpu" and mscale == 1.0
    torch.testing.assert_close(emb[:, 0, 0, :4], want)


CHECKS: dict[str, Callable[[], None]] = {
    "current_device": _check_current_device,
    "device_mode": _check_device_mode,
    "tensor_cuda": _check_tensor_cuda,
    "tensor_type": _check_tensor_type,
    "rng_tracker": _check_rng_tracker,
    "streams": _check_streams,
    "thread_local": _check_thread_local,
    "yarn_rope": _check_yarn_rope,
}


def _sgd_step_vs_reference(hf_dir: str, lr: float) -> float:
    """One Adam step with Megatron DDP + DistributedOptimizer (DP=world) on per-rank batches;
    returns max |Δweight| against transformers + torch Adam on the concatenated global batch.

    adam_eps=1 keeps the first Adam update ``lr * g / (|g| + 1)`` a smooth function of the
    gradient (with a tiny eps it is ``lr * sign(g)`` and fp32 noise on near-zero grads flips it).
    """
    import transformers as tf
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import export_hf_weights, load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    cfg = load_hf_config(hf_dir)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    chunks = build_model_chunks(cfg, wrap_ddp=True, ddp_config=ddp)
    load_hf_weights(chunks, cfg, HFCheckpointReader(hf_dir))
    chunks[0].module.config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, adam_eps=1.0, weight_decay=0.0,
                        use_distributed_optimizer=True, clip_grad=1e9), chunks)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (2 * dp, 9), generator=gen)
    mine = ids[2 * dp_rank: 2 * dp_rank + 2]
    pos = torch.arange(8).expand(2, 8)

    def step(data_iter, model):
        batch = next(data_iter)
        logits = model(batch[:, :-1], pos, None)[..., : cfg.vocab_size]

        def loss_func(out):
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), batch[:, 1:].reshape(-1))
            return loss, {"loss": loss.detach()}

        return logits, loss_func

    for c in chunks:
        c.train()
        c.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([mine]), model=chunks,
                                num_microbatches=1, seq_length=8, micro_batch_size=2, forward_only=False)
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm is not None and grad_norm > 0

    hf = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = hf(ids[:, :-1]).logits
    F.cross_entropy(out.reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    ref_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters())).item()
    assert abs(grad_norm - ref_norm) <= 1e-5 * ref_norm, (grad_norm, ref_norm)
    torch.optim.Adam(hf.parameters(), lr=lr, eps=1.0).step()
    ref = dict(hf.named_parameters())
    moved = max(p.grad.abs().max().item() for p in hf.parameters()) > 0
    assert moved
    return max((t - ref[n].detach()).abs().max().item() for n, t in export_hf_weights(chunks, cfg))


def _check_load_errors(hf_dir: str) -> None:
    """A config/weights mismatch and a missing tensor both name the tensor and the cause."""
    import pytest

    from mrl.megatron.hf_io import HFCheckpointReader
    from mrl.megatron.mapping import load_hf_weights
    from mrl.megatron.provider import build_model_chunks, load_hf_config

    cfg = load_hf_config(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    wrong = load_hf_config(hf_dir)
    wrong.intermediate_size = 96  # the checkpoint has 128
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight.*config\.json does not match"):
        load_hf_weights(build_model_chunks(wrong), wrong, reader)

    def without_norm(name: str) -> torch.Tensor:
        if name == "model.norm.weight":
            raise KeyError(f"tensor {name!r} is missing")
        return reader.get(name)

    with pytest.raises(KeyError, match="model.norm.weight"):
        load_hf_weights(build_model_chunks(cfg), cfg, without_norm)


def cpu_support_rank(rank: int, world: int, hf_dir: str) -> dict[str, str]:
    """Run every check; returns check name -> "ok" or the traceback (so each is its own test)."""
    from mrl.megatron.parallel import init_parallel

    results: dict[str, str] = {}
    try:
        _check_inactive_before()
        results["inactive_before"] = "ok"
    except Exception:  # noqa: BLE001 - reported per check to the parent
        results["inactive_before"] = traceback.format_exc()
    init_parallel(device="cpu", tp=world)
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per check to the parent
            results[name] = traceback.format_exc()
    init_parallel(device="cpu", tp=1)  # DP = world for the optimizer step
    try:
        diff = _sgd_step_vs_reference(hf_dir, lr=0.5)
        print(f"rank {rank}: DDP+DistributedOptimizer Adam step max |Δw| vs torch = {diff:.3g}")
        results["ddp_distopt_step"] = "ok" if diff <= 1e-6 else f"max |Δw| = {diff:.3g} > 1e-6"
    except Exception:  # noqa: BLE001 - reported per check to the parent
        results["ddp_distopt_step"] = traceback.format_exc()
    try:
        _check_load_errors(hf_dir)
        results["load_errors"] = "ok"
    except Exception:  # noqa: BLE001 - reported per check to the parent
        results["load_errors"] = traceback.format_exc()
    try:
        from megatron.core import parallel_state as ps

        from mrl.megatron.parallel import destroy_parallel

        destroy_parallel()
        destroy_parallel()  # safe twice
        assert not torch.distributed.is_initialized() and not ps.model_parallel_is_initialized()
        results["destroy_parallel"] = "ok"
    except Exception:  # noqa: BLE001 - reported per check to the parent
        results["destroy_parallel"] = traceback.format_exc()
    return results
