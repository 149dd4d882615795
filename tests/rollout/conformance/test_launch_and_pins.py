"""One SGLang version everywhere, and our launch command as SGLang's own argument parser reads it; an engine
over several nodes: each node's command as SGLang parses it, the TP ranks and GPUs SGLang's launcher gives
each node, and the weight-sync group rank SGLang's receiver takes on each of them."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mrl.rollout.sglang_launcher import (
    SGLANG_VERSION,
    EngineLaunchError,
    SGLangLaunchSpec,
    build_sglang_command,
    check_sglang_version,
)
from tests.helpers.sglang_real import require

REPO = Path(__file__).resolve().parents[3]


def test_one_sglang_version_pinned_everywhere():
    pins = {
        "setup.py": re.findall(r'"sglang==([^"]+)"', (REPO / "setup.py").read_text()),
        "docker/Dockerfile": re.findall(r"ARG SGLANG_VERSION=(\S+)", (REPO / "docker/Dockerfile").read_text()),
        "requirements-sglang-cpu.txt": re.findall(r"^sglang==(\S+)", (REPO / "requirements-sglang-cpu.txt").read_text(), re.MULTILINE),
        "README.md": re.findall(r"SGLang (\d+\.\d+\.\d+\S*) is the supported", (REPO / "README.md").read_text()),
    }
    for where, found in pins.items():
        assert found and set(found) == {SGLANG_VERSION}, f"{where} pins {found}, mrl speaks SGLang {SGLANG_VERSION}"
    assert require().__version__ == SGLANG_VERSION  # the code the conformance suite runs is that release


def test_other_sglang_versions_are_refused_with_the_fix():
    assert check_sglang_version(SGLANG_VERSION) == SGLANG_VERSION
    with pytest.raises(EngineLaunchError, match=rf"pip install sglang=={re.escape(SGLANG_VERSION)}"):
        check_sglang_version("0.5.1.post3")


def test_launch_command_parses_with_sglang_server_args():
    require()
    from sglang.srt.server_args import ServerArgs

    spec = SGLangLaunchSpec(model_path="/models/m", port=30001, host="127.0.0.1", tp_size=2, mem_fraction_static=0.6,
                            colocated=True, base_gpu_id=4, dtype="bfloat16", random_seed=7, admin_api_key="tok",
                            extra_args=["--max-running-requests", "256"])  # rollout.max_num_seqs
    cmd = build_sglang_command(spec, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(cmd[3:])  # exits (SystemExit) on a flag SGLang does not know
    assert (args.model_path, args.port, args.tp_size, args.base_gpu_id) == ("/models/m", 30001, 2, 4)
    assert args.mem_fraction_static == 0.6 and args.enable_memory_saver and args.random_seed == 7
    assert args.dtype == "bfloat16" and args.admin_api_key == "tok" and args.api_key is None and args.skip_server_warmup
    assert args.max_running_requests == 256
    assert not args.enable_return_routed_experts
    moe = build_sglang_command(SGLangLaunchSpec(model_path="/m", port=1, enable_return_routed_experts=True), "python")
    assert parser.parse_args(moe[3:]).enable_return_routed_experts  # routing replay (R3)


def test_the_run_token_guards_sglangs_control_routes_and_leaves_generate_open():
    """SGLang's own auth rule over its own routes' auth levels, with the key our launch sets: what
    the pool and the weight syncer send (Bearer token) opens the control routes; /generate needs none
    (so sglang_router can forward generations)."""
    require()
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.utils.auth import decide_request_auth

    levels = {r.path: getattr(r.endpoint, "_auth_level", None) for r in hs.app.routes if hasattr(r, "endpoint")}

    def allowed(path, header):
        return decide_request_auth(method="POST", path=path, authorization_header=header, api_key=None,
                                   admin_api_key="tok", auth_level=levels[path]).allowed

    for path in ("/generate", "/v1/completions", "/health_generate"):
        assert allowed(path, None), path
    for path in ("/pause_generation", "/update_weights_from_distributed", "/begin_weight_update",
                 "/init_weights_update_group", "/release_memory_occupation", "/flush_cache"):
        assert not allowed(path, None) and not allowed(path, "Bearer nope") and allowed(path, "Bearer tok"), path


def test_engine_process_refuses_an_sglang_launch_without_the_supported_release(tmp_path, monkeypatch):
    """The check runs where SGLang would start (the engine's node), before any process is spawned."""
    import importlib.metadata as md

    from mrl.rollout.sglang_launcher import EngineProcess

    real = md.version
    monkeypatch.setattr(md, "version", lambda name: "0.5.1.post3" if name == "sglang" else real(name))
    proc = EngineProcess(build_sglang_command(SGLangLaunchSpec(model_path="/m", port=1)), "http://127.0.0.1:1",
                         log_path=tmp_path / "engine.log")
    with pytest.raises(EngineLaunchError, match="SGLang 0.5.1.post3 is installed"):
        proc.start(wait=False)
    assert not proc.alive() and not (tmp_path / "engine.log").exists()


def _multinode_slots():
    """Two TP16 engines over two 8-GPU nodes each (the fourth bundle on GPUs 8-15 of a 16-GPU host)."""
    from mrl.config import load_config
    from mrl.driver.engines import plan_engines
    from tests.driver.test_engines import MN, MN_RECIPE, whole_nodes

    cfg = load_config(MN_RECIPE, [*MN, "cluster.nnodes=8", "rollout.num_engines=2"])
    return cfg, plan_engines(cfg, whole_nodes([range(8), range(8), range(8), range(8, 16)]), 2)


def _sglang_tp_ranks(args: argparse.Namespace) -> tuple[range, int]:
    """The TP ranks SGLang's launcher starts on ``args.node_rank`` (its own ``_calculate_rank_ranges`` under
    these server args) and the TP ranks per node."""
    from sglang.srt.entrypoints.engine import _calculate_rank_ranges
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(nnodes=args.nnodes, node_rank=args.node_rank, tp_size=args.tp_size,
                                            pp_size=args.pp_size, base_gpu_id=args.base_gpu_id):
        pp_ranks, tp_ranks, _, tp_per_node = _calculate_rank_ranges(args.node_rank)
    assert list(pp_ranks) == [0]
    return tp_ranks, tp_per_node


def test_multinode_engine_commands_as_sglang_reads_them():
    """Each node's argv through SGLang's parser: --nnodes/--node-rank/--dist-init-addr (node-rank 0's ip and the
    port free there), --tp-size the whole engine's, --base-gpu-id that node's first GPU; SGLang's launcher then
    runs TP ranks [r*8, (r+1)*8) of node r on GPUs base_gpu_id + tp_rank % 8 (its gpu_id formula, pp=1, step 1),
    which are the GPUs Ray gave that node's bundle, and the nodes together run every TP rank once."""
    require()
    from sglang.srt.server_args import ServerArgs

    from mrl.driver.engines import engine_command

    cfg, slots = _multinode_slots()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for slot in slots:
        ranks = []
        for node in slot.nodes:
            cmd, _ = engine_command(cfg, slot, "tok", dtype="bfloat16", node_rank=node.node_rank)
            args = parser.parse_args(cmd[3:])
            assert (args.nnodes, args.node_rank, args.dist_init_addr, args.tp_size, args.port, args.host) == (
                2, node.node_rank, f"{slot.node_ip}:{slot.dist_init_port}", 16, slot.port, "0.0.0.0")
            assert args.admin_api_key == "tok" and not args.enable_memory_saver
            tp_ranks, per_node = _sglang_tp_ranks(args)
            assert per_node == 8 and [args.base_gpu_id + t % per_node for t in tp_ranks] == list(node.gpu_ids)
            ranks += tp_ranks
        assert ranks == list(range(16))
    assert slots[1].nodes[1].gpu_ids == tuple(range(8, 16))  # so a wrong --base-gpu-id shows


def test_weight_sync_group_ranks_of_multinode_engines_in_sglangs_receiver(monkeypatch):
    """The sender's /init_weights_update_group bodies (``group_init_payloads``, what ``DistributedTransport.init``
    posts to each engine's node-rank 0) given to SGLang's own ``WeightUpdater.init_weights_update_group`` on every
    TP rank of every node: the ranks taken are 1..32 once each (engine 0: 1-16, engine 1: 17-32) in a world of 33
    with the trainer's source as rank 0. The rendezvous itself cannot complete without its 33 members: SGLang's
    ``init_custom_process_group`` is replaced by a recorder here (a real group with SGLang's code on the other side:
    test_sglang_weight_sync.py, one-rank engines)."""
    require()
    import torch.distributed as dist
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu

    from mrl.driver.engines import engine_command
    from mrl.rollout.weight_sync.transports import group_init_payloads
    from mrl.workers.rank import engine_world_sizes

    joined: list[tuple[int, int, int, str]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # SGLang asserts its engine's own default group
    cfg, slots = _multinode_slots()
    # the sizes the trainer's rank hands its WeightSyncer (TrainRank.init_weight_sync), from the same function
    payloads = group_init_payloads(engine_world_sizes(cfg.rollout.engine_tp_size, len(slots)), "10.0.0.9", 40000,
                                   "mrl_weight_sync_pp0", "nccl")
    parser = argparse.ArgumentParser()
    from sglang.srt.server_args import ServerArgs

    ServerArgs.add_cli_args(parser)
    for slot, payload in zip(slots, payloads):
        for node in slot.nodes:
            args = parser.parse_args(engine_command(cfg, slot, None, dtype="bfloat16", node_rank=node.node_rank)[0][3:])
            for tp_rank in _sglang_tp_ranks(args)[0]:
                def record(*, rank, world_size, init_method, group_name, backend, e=slot.index):
                    joined.append((e, rank, world_size, init_method))
                    return object()

                monkeypatch.setattr(wu, "init_custom_process_group", record)
                updater = wu.WeightUpdater(tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None,
                                           custom_weight_loaders={}, get_model=lambda: None,
                                           update_model_fields=lambda *a, **k: None, recapture_cuda_graph=lambda: None,
                                           get_model_runner=lambda: None)
                ok, message = updater.init_weights_update_group(**payload)
                assert ok, message
    assert sorted(r for _, r, _, _ in joined) == list(range(1, 33))
    assert {r for e, r, _, _ in joined if e == 0} == set(range(1, 17)) and {w for _, _, w, _ in joined} == {33}
    assert {m for *_, m in joined} == {"tcp://10.0.0.9:40000"}
