"""Engine placement and command lines: which node/GPUs each engine uses, SGLang's and the embedded
engine's argv from the config, and the errors for layouts an engine cannot span (no Ray needed)."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from mrl.config import ConfigError, load_config
from mrl.config.run_plan import plan_run
from mrl.driver.engines import (
    TOKEN_ENV,
    EngineNode,
    EngineSlot,
    engine_command,
    plan_engines,
    run_token,
    spans_nodes,
)
from mrl.errors import UnsupportedConfigError

GPU_RECIPE = "mrl_configs/qwen2.5-0.5b_grpo_1x8.yaml"


def _node(node: str, ip: str, gpus: list[int]) -> dict:
    return {"node_id": node, "ip": ip, "gpu_ids": gpus, "free_port": 1}


def _dtype(cfg, device: str = "cuda") -> str:
    """The run plan's dtype, which build hands to the engines (the trainer ranks' dtype)."""
    return plan_run(cfg, device).dtype


def _gpu_infos(nodes: int = 1, per_node: int = 8) -> list[dict]:
    return [_node(f"n{k}", f"10.0.0.{k + 1}", [g]) for k in range(nodes) for g in range(per_node)]


def test_sglang_engines_tp2_colocated_on_one_node() -> None:
    cfg = load_config(GPU_RECIPE, ["rollout.engine_tp_size=2"])
    slots = plan_engines(cfg, _gpu_infos(), 4)
    assert [s.gpu_ids for s in slots] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.bundle for s in slots] == [0, 2, 4, 6]  # the bundle of each engine's first trainer rank
    assert [s.url for s in slots] == [f"http://127.0.0.1:{30000 + i}" for i in range(4)]
    cmd, env = engine_command(cfg, slots[1], token=None, dtype=_dtype(cfg))
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and env == {}
    flags = dict(itertools.pairwise(cmd))
    assert flags["--model-path"] == "Qwen/Qwen2.5-0.5B-Instruct" and flags["--tp-size"] == "2"
    assert flags["--base-gpu-id"] == "2" and flags["--port"] == "30001" and flags["--dtype"] == "bfloat16"
    assert flags["--mem-fraction-static"] == str(cfg.rollout.mem_fraction_static)
    assert "--enable-memory-saver" in cmd and "--skip-server-warmup" in cmd and "--admin-api-key" not in cmd


def test_two_nodes_need_a_routable_host_and_get_the_token() -> None:
    with pytest.raises(ConfigError, match="rollout.host=127.0.0.1 with cluster.nnodes=2.*rollout.host=0.0.0.0"):
        load_config(GPU_RECIPE, ["cluster.nnodes=2"])  # refused before anything starts
    # ... and again if Ray spreads a one-node config over two nodes
    cfg = load_config(GPU_RECIPE, ["cluster.n_gpus_per_node=16"])
    with pytest.raises(UnsupportedConfigError, match="rollout.host=127.0.0.1 is loopback.*rollout.host=0.0.0.0"):
        plan_engines(cfg, _gpu_infos(nodes=2), 16)
    # two colocated nodes: CUDA IPC does not cross nodes, the disk transport does (config validation)
    cfg = load_config(GPU_RECIPE, ["cluster.nnodes=2", "rollout.host=0.0.0.0", "rollout.weight_sync.transport=disk"])
    slots = plan_engines(cfg, _gpu_infos(nodes=2), 16)
    assert slots[9].url == "http://10.0.0.2:30009" and slots[9].gpu_ids == (1,)
    token = run_token(cfg)
    assert token and len(token) >= 32 and run_token(cfg) != token  # fresh per run
    cmd, _ = engine_command(cfg, slots[9], token, dtype=_dtype(cfg))
    assert cmd[cmd.index("--admin-api-key") + 1] == token and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert "--api-key" not in cmd  # it would guard /generate too


def test_an_engine_spanning_nodes_is_refused() -> None:
    cfg = load_config(GPU_RECIPE, ["cluster.nnodes=2", "cluster.n_gpus_per_node=3", "rollout.host=0.0.0.0",
                                   "rollout.weight_sync.transport=disk",
                                   "rollout.engine_tp_size=2", "actor.ppo_mini_batch_size=60",
                                   "data.train_batch_size=240"])
    with pytest.raises(UnsupportedConfigError, match="engine 1 would span nodes"):
        plan_engines(cfg, _gpu_infos(nodes=2, per_node=3), 3)


def test_non_consecutive_gpus_are_refused() -> None:
    cfg = load_config(GPU_RECIPE, ["rollout.engine_tp_size=2"])
    infos = [_node("a", "1.1.1.1", [g]) for g in (0, 2, 1, 3)]
    with pytest.raises(UnsupportedConfigError, match=r"GPU ids \[0, 2\], not consecutive"):
        plan_engines(cfg, infos, 2)


def test_embedded_engine_command_on_cpu_and_cuda(tmp_path) -> None:
    (tmp_path / "m").mkdir()
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tmp_path}/m", "rollout.host=0.0.0.0"])
    slot = plan_engines(cfg, [_node("a", "10.1.1.1", []), _node("a", "10.1.1.1", [])], 2)[1]
    assert slot.url == "http://10.1.1.1:30001"
    cmd, env = engine_command(cfg, slot, token="secret", dtype=_dtype(cfg, "cpu"))
    assert cmd[1:3] == ["-m", "mrl.rollout.engine.server"] and "secret" not in cmd  # argv is readable by other users
    assert env[TOKEN_ENV] == "secret" and cmd[cmd.index("--token-env") + 1] == TOKEN_ENV
    assert cmd[cmd.index("--device") + 1] == "cpu" and cmd[cmd.index("--dtype") + 1] == "float32"
    assert cmd[cmd.index("--seed") + 1] == str(cfg.trainer.seed + 1)
    gpu_cfg = load_config(GPU_RECIPE, ["rollout.engine=torch"])
    cmd, env = engine_command(gpu_cfg, plan_engines(gpu_cfg, _gpu_infos(), 8)[5], token=None, dtype=_dtype(gpu_cfg))
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and cmd[cmd.index("--device") + 1] == "cuda"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and TOKEN_ENV not in env


def test_loopback_engines_get_the_run_token_too(tmp_path) -> None:
    # issue 19: loopback engines accepted pause / update_weights_from_disk / release_memory from any local process
    (tmp_path / "m").mkdir()
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tmp_path}/m"])
    assert cfg.rollout.host == "127.0.0.1"
    token = run_token(cfg)
    assert token and len(token) >= 32 and run_token(cfg) != token
    slot = plan_engines(cfg, [_node("a", "10.1.1.1", []), _node("a", "10.1.1.1", [])], 2)[0]
    cmd, env = engine_command(cfg, slot, token, dtype=_dtype(cfg, "cpu"))
    assert env[TOKEN_ENV] == token and cmd[cmd.index("--token-env") + 1] == TOKEN_ENV and token not in cmd
    gpu = load_config(GPU_RECIPE, [])
    assert run_token(gpu)  # SGLang engines: --admin-api-key (control endpoints only), sent by the pool
    assert run_token(load_config(GPU_RECIPE, ["rollout.router=sglang_router"]))  # /generate stays open for the router


def test_embedded_engine_with_token_guards_control_only(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from mrl.rollout.engine.server import Engine, build_app
    from tests.helpers.tiny_models import make_tiny_hf

    engine = Engine(str(make_tiny_hf(tmp_path / "hf", "qwen2")))
    with TestClient(build_app(engine, token="s3cret")) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        for path in ("/pause_generation", "/update_weights_from_disk", "/release_memory_occupation"):
            assert c.post(path, json={}).status_code == 401, path
        assert c.post("/pause_generation", json={}, headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_max_num_seqs_reaches_both_engines(tmp_path) -> None:
    """rollout.max_num_seqs: SGLang's --max-running-requests (a flag its ServerArgs parses), the embedded --max-running."""
    (tmp_path / "m").mkdir()
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tmp_path}/m", "rollout.max_num_seqs=3"])
    cmd, _ = engine_command(cfg, plan_engines(cfg, [_node("a", "10.1.1.1", [])] * 2, 2)[0], token=None, dtype="float32")
    assert cmd[cmd.index("--max-running") + 1] == "3"
    gpu_cfg = load_config(GPU_RECIPE, ["rollout.max_num_seqs=256"])
    cmd, _ = engine_command(gpu_cfg, plan_engines(gpu_cfg, _gpu_infos(), 8)[0], token=None, dtype="bfloat16")
    assert cmd[cmd.index("--max-running-requests") + 1] == "256"
    default, _ = engine_command(load_config(GPU_RECIPE), plan_engines(gpu_cfg, _gpu_infos(), 8)[0], token=None,
                                dtype="bfloat16")
    assert "--max-running-requests" not in default


@pytest.mark.parametrize(("dtype", "cpu", "gpu"), [(None, "float32", "bfloat16"), ("bfloat16", "bfloat16", "bfloat16"),
                                                   ("float32", "float32", "float32")])
def test_model_dtype_reaches_every_engine(tmp_path, dtype, cpu, gpu) -> None:
    """model.dtype is the engines' dtype on CPU too (it was forced to float32 there); null = each device's default.
    The engines get the run plan's dtype, the one the trainer ranks build their models in."""
    (tmp_path / "m").mkdir()
    over = [] if dtype is None else [f"model.dtype={dtype}"]
    cfg = load_config("mrl_configs/quickstart.yaml", [f"model.path={tmp_path}/m", "model.dtype=null", *over])
    cmd, _ = engine_command(cfg, plan_engines(cfg, [_node("a", "10.1.1.1", [])] * 2, 2)[0], token=None,
                            dtype=_dtype(cfg, "cpu"))
    assert cmd[cmd.index("--dtype") + 1] == cpu
    gpu_cfg = load_config(GPU_RECIPE, ["model.dtype=null", *over])
    cmd, _ = engine_command(gpu_cfg, plan_engines(gpu_cfg, _gpu_infos(), 8)[0], token=None, dtype=_dtype(gpu_cfg))
    assert dict(itertools.pairwise(cmd))["--dtype"] == gpu


# An SGLang engine over two whole nodes (docs/driver.md, 'Engines over several nodes'): GLM-4.5-Air's recipe
# (96 heads) on 6 nodes, the actor on nodes 0-3, one TP16 engine on nodes 4-5.
MN_RECIPE = "mrl_configs/glm-4.5-air_grpo_5x8_ep16.yaml"
MN = ["cluster.nnodes=6", "rollout.engine_tp_size=16"]


def whole_nodes(gpu_ranges: list[range]) -> list[dict]:
    """Engine bundles as ``engine_bundle_info`` reports them (placement_info + a free port), one per node."""
    return [{"node_id": f"n{k}", "ip": f"10.0.0.{k + 1}", "gpu_ids": list(g), "free_port": 41000 + k}
            for k, g in enumerate(gpu_ranges)]


def test_an_engine_over_two_whole_nodes_plans() -> None:
    from mrl.config.plan_report import plan_text

    text = plan_text(load_config(MN_RECIPE, MN))
    assert "rollout        16 devices [node4:0-7, node5:0-7] 1 x sglang engine(s), tp=16 over 2 nodes each" in text
    assert "rollout.weight_sync.transport=distributed" in text
    disk = plan_text(load_config(MN_RECIPE, [*MN, "rollout.weight_sync.transport=disk"]))
    assert "transport=disk with engines over 2 nodes" in disk and "filesystem all of them read" in disk


@pytest.mark.parametrize(("over", "match"), [
    (["rollout.engine_tp_size=12"], (r"rollout.engine_tp_size=12 exceeds cluster.n_gpus_per_node=8 and is not a "
                                     r"multiple of it.*fix: rollout.engine_tp_size=16 \(2 whole nodes\)")),
    (["rollout.placement=colocated", "rollout.num_engines=null"],
     r"\(each engine over 2 nodes\) with rollout.placement=colocated.*fix: rollout.placement=separate"),
    (["rollout.weight_sync.transport=tensor"], (r"transport=tensor passes in-process tensors and needs rollout."
                                                r"placement=colocated; fix: use transport=distributed \(or disk\)")),
    (["rollout.engine=torch"], r"with rollout.engine=torch: only SGLang engines span nodes.*fix: rollout.engine=sglang"),
    (["rollout.host=10.0.0.1"], r"rollout.host=10.0.0.1 with .*must be an address of each node; fix: rollout.host=0.0.0.0"),
    (["cluster.nnodes=7", "reward_model.enable=true", "reward_model.placement=separate", "reward_model.num_devices=4",
      "reward_model.model.path=zai-org/GLM-4.5-Air"],
     (r"separate engines would start at device 36 \(node4:4\), mid-node.*\(ref/critic/reward_model/teacher "
      r"num_devices, 4 now\) a multiple of 8")),
])
def test_engines_over_nodes_are_refused_where_they_cannot_run(over: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(MN_RECIPE, [*MN, *over])


def test_engines_over_two_nodes_get_one_whole_node_bundle_per_node() -> None:
    cfg = load_config(MN_RECIPE, [*MN, "cluster.nnodes=8", "rollout.num_engines=2"])
    # Ray gave the fourth bundle GPUs 8-15 of its node (a 16-GPU host): its node's --base-gpu-id is 8
    slots = plan_engines(cfg, whole_nodes([range(8), range(8), range(8), range(8, 16)]), 2)
    assert [s.url for s in slots] == ["http://10.0.0.1:30000", "http://10.0.0.3:30001"]  # node-rank 0 serves
    assert [(n.node_rank, n.node_ip, n.gpu_ids, n.bundle) for n in slots[1].nodes] == [
        (0, "10.0.0.3", tuple(range(8)), 2), (1, "10.0.0.4", tuple(range(8, 16)), 3)]
    assert [s.dist_init_port for s in slots] == [41000, 41002] and [s.nnodes for s in slots] == [2, 2]
    assert slots[1].bundle == 2 and slots[1].gpu_ids == tuple(range(8))  # what the judge's engines sit next to
    # the weight-sync rendezvous leaves loopback when an engine's other node is elsewhere, even if node-rank 0 and
    # every trainer rank share a node
    one = [EngineSlot(0, "n0", "10.0.0.1", (0,), 0, "http://10.0.0.1:30000", 30000)]
    assert not spans_nodes(one, [{"node_id": "n0"}])
    assert spans_nodes([replace(one[0], followers=(EngineNode(1, "n1", "10.0.0.2", (0,), 1),))], [{"node_id": "n0"}])
    with pytest.raises(UnsupportedConfigError, match=r"engine 1: its 2 bundles landed on nodes \['10.0.0.3', '10.0.0.3'\]"):
        plan_engines(cfg, whole_nodes([range(8), range(8), range(8), range(8, 16)])[:3] + [
            {"node_id": "n2", "ip": "10.0.0.3", "gpu_ids": list(range(8, 16)), "free_port": 1}], 2)
    with pytest.raises(UnsupportedConfigError, match=r"GPU ids \[0, 1, 2, 3\], not 8 consecutive"):
        plan_engines(cfg, whole_nodes([range(8), range(4), range(8), range(8)]), 2)
    with pytest.raises(UnsupportedConfigError, match="need 4 whole-node bundles"):
        plan_engines(cfg, whole_nodes([range(8)] * 3), 2)
    colocated = load_config(MN_RECIPE, [*MN, "rollout.placement=colocated"], check=False)  # as config refuses it
    with pytest.raises(UnsupportedConfigError, match="spans 2 nodes, which only rollout.engine=sglang with "
                                                     "rollout.placement=separate"):
        plan_engines(colocated, whole_nodes([range(8)] * 4), 2)
