"""One test per CPU redirect of mrl.megatron.cpu_support (2 gloo ranks, TP=2 then DP=2)."""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_ranks
from tests.helpers.tiny_models import make_tiny_hf
from tests.megatron._cpu_ranks import CHECKS, cpu_support_rank

NAMES = ["inactive_before", *CHECKS, "ddp_distopt_step", "load_errors", "destroy_parallel"]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    hf_dir = make_tiny_hf(tmp_path_factory.mktemp("cpu") / "llama", "llama")
    return run_ranks(cpu_support_rank, 2, args=(str(hf_dir),), timeout_s=240)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("check", NAMES)
def test_redirect(rank_results, check):
    for rank, res in enumerate(rank_results):
        assert res[check] == "ok", f"rank {rank}: {res[check]}"

