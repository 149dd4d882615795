"""Argument checks of mrl.megatron.parallel.init_parallel (they run before anything is set up;
the multi-rank paths are exercised by test_model_parity.py and test_cpu_support.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mrl.megatron.parallel import init_parallel


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"device": "tpu"}, "cluster.device"),
        ({"device": "cpu", "tp": 0}, "tp=0"),
        ({"device": "cpu", "pp": 1, "vpp": 2}, "vpp=2 needs pp > 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_parallel(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_without_gpu_is_clear_and_leaves_cpu_support_off():
    import mrl.megatron.cpu_support as cs

    with pytest.raises(RuntimeError, match="cluster.device: cpu"):
        init_parallel(device="cuda")
    assert not cs._PATCHED and not cs.cpu_support_active()
