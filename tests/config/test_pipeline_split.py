"""mrl's pipeline split (mrl/config/pipeline_split.py, what `mrl plan` checks before Megatron starts) against
Megatron-Core's own: for every (layers, PP, VPP, first, last) in a grid, the split is accepted exactly when
Megatron's ``TransformerConfig`` accepts it, and the per-stage layer counts equal Megatron's
``get_num_layers_to_build`` summed over each stage's VPP chunks (``pp_rank``/``vp_stage`` passed explicitly: no
process groups needed). Plus the plan's errors and the memory estimate of the largest stage."""
from __future__ import annotations

import itertools

import pytest

from mrl.config.pipeline_split import SplitError, stage_layer_counts, suggest_split


def _megatron_counts(num_layers, pp, vpp, first, last):
    """Megatron's split, or None when its TransformerConfig refuses the sizes."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    try:
        cfg = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=1,
                                pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                pipeline_dtype=__import__("torch").float32)
    except (ValueError, AssertionError):
        return None
    chunks = range(vpp) if vpp else [None]
    try:  # an even split's divisibility Megatron asserts only when it builds the layers
        counts = [sum(get_num_layers_to_build(cfg, vp_stage=v, pp_rank=r) for v in chunks) for r in range(pp)]
    except AssertionError:
        return None
    # Megatron 0.16 accepts first + last > num_layers with middle stages and would build negative counts there:
    # mrl refuses those
    return counts if sum(counts) == num_layers and min(counts) >= 0 else None


GRID = [(n, pp, vpp, first, last)
        for n, pp, vpp, first, last in itertools.product((4, 7, 8, 12, 61), (2, 3, 4, 16), (None, 2),
                                                          (None, 1, 2, 4), (None, 1, 2, 4))
        if not (first is None and last is None and pp * (vpp or 1) > n)]


def test_split_equals_megatrons_over_a_grid():
    accepted = refused = 0
    mismatches = []
    for n, pp, vpp, first, last in GRID:
        want = _megatron_counts(n, pp, vpp, first, last)
        try:
            got = stage_layer_counts(n, pp, vpp, first, last)
        except SplitError:
            got = None
        if got != want:
            mismatches.append(((n, pp, vpp, first, last), got, want))
        accepted += got is not None
        refused += got is None
    assert not mismatches, mismatches[:10]
    assert accepted > 50 and refused > 50, (accepted, refused)  # both sides of the rule exercised


def test_deepseek_v3_splits_of_the_peers():
    # verl's DeepSeek-V3 671B example: PP16, first 4, last 1; and the suggestion mrl prints for 61 layers at PP16
    assert stage_layer_counts(61, 16, None, 4, 1) == [4] * 15 + [1]
    assert suggest_split(61, 16) == {"num_layers_in_last_pipeline_stage": 1}
    assert stage_layer_counts(61, 16, None, None, 1) == [4] * 15 + [1]
    assert suggest_split(92, 8) == {"num_layers_in_last_pipeline_stage": 8}  # GLM-4.5: 12 x7 + 8
    assert suggest_split(5, 4) == {"num_layers_in_first_pipeline_stage": 2}
    assert suggest_split(64, 16) is None
    for n, pp in itertools.product(range(2, 100), range(2, 17)):  # every suggestion is a valid split
        hint = suggest_split(n, pp)
        if hint:
            counts = stage_layer_counts(n, pp, None, hint.get("num_layers_in_first_pipeline_stage"),
                                        hint.get("num_layers_in_last_pipeline_stage"))
            assert sum(counts) == n and min(counts) >= 1


def _plan_errors(tmp_path, megatron, num_layers=61):
    import json

    from mrl.config import check_config, load_config

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 128}))
    cfg = load_config(None, [f"model.path={model}", "cluster.device=cpu", "cluster.n_gpus_per_node=16",
                             "actor.ppo_mini_batch_size=16", "data.train_batch_size=16",
                             "actor.ppo_micro_batch_size_per_gpu=1",
                             *(f"actor.megatron.{k}={v}" for k, v in megatron.items())], check=False)
    return [e for e in check_config(cfg)[0] if "layers" in e]


def test_plan_refuses_a_split_megatron_would_refuse_and_names_one_that_works(tmp_path):
    errs = _plan_errors(tmp_path, {"pipeline_model_parallel_size": 16})
    assert len(errs) == 1 and "actor.megatron.num_layers_in_last_pipeline_stage=1" in errs[0], errs
    assert _plan_errors(tmp_path, {"pipeline_model_parallel_size": 16, "num_layers_in_last_pipeline_stage": 1}) == []
    assert _plan_errors(tmp_path, {"pipeline_model_parallel_size": 16, "num_layers_in_first_pipeline_stage": 4,
                                   "num_layers_in_last_pipeline_stage": 1}) == []
    errs = _plan_errors(tmp_path, {"pipeline_model_parallel_size": 16, "num_layers_in_first_pipeline_stage": 3})
    assert len(errs) == 1 and "num_layers_in_first_pipeline_stage=3" in errs[0] and "fix:" in errs[0], errs
    errs = _plan_errors(tmp_path, {"num_layers_in_last_pipeline_stage": 1}, num_layers=4)
    assert len(errs) == 1 and "pipeline_model_parallel_size > 1" in errs[0], errs


@pytest.mark.parametrize("pp,first,last,counts", [
    (16, None, None, [4] * 16),      # 64 layers, even
    (16, None, 1, [4] * 15 + [1]),   # 61 layers from here on
    (16, 4, 1, [4] * 15 + [1]),
    (2, 1, None, [1, 60]),           # the last stage is the largest
    (3, 1, 1, [1, 59, 1]),           # a middle stage is the largest
])
def test_memory_estimate_takes_the_largest_stage(pp, first, last, counts):
    from mrl.config.hf import ModelShape
    from mrl.config.parallel import ParallelConfig
    from mrl.config.plan_report import params_per_device

    shape = ModelShape(model_type="qwen2", vocab_size=256, hidden_size=64,
                       num_layers=64 if first is None and last is None else 61, num_heads=4, num_kv_heads=4,
                       head_dim=16, intermediate_size=128, max_positions=None, tie_word_embeddings=False,
                       qkv_bias=False, qk_norm=False)
    par = ParallelConfig(pipeline_model_parallel_size=pp,
                         num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last)
    layer = 4 * 64 * 64 + 2 * 64 + 3 * 64 * 128  # q, k, v, o (4 heads x 16 = 64) + 2 norms + the SwiGLU MLP
    assert shape.layer_params() == (layer, 0)
    embed = 256 * 64  # vocab 256 is already a multiple of 128: no padding
    want = max(embed + counts[0] * layer, *(c * layer for c in counts[1:-1]), counts[-1] * layer + 64 + embed)
    assert params_per_device(shape, par, divisible_by=128) == want


@pytest.mark.parametrize("ep,dp,edp", [(8, 8, 1), (4, 8, 2), (2, 8, 4)])
def test_expert_optimizer_state_is_sharded_over_expert_data_parallel_ranks(ep, dp, edp):
    """Megatron's distributed optimizer shards an expert's Adam states over its expert-data-parallel group
    (EDP = devices / (ETP * EP * PP)), the dense parameters' over DP: with EP8 on 8 devices nothing of the
    experts' states is sharded."""
    from mrl.config.hf import ModelShape
    from mrl.config.parallel import ParallelConfig
    from mrl.config.plan_report import params_per_device, trained_memory

    shape = ModelShape(model_type="qwen3_moe", vocab_size=256, hidden_size=64, num_layers=4, num_heads=4,
                       num_kv_heads=4, head_dim=16, intermediate_size=128, max_positions=None,
                       tie_word_embeddings=False, qkv_bias=False, qk_norm=False, num_experts=8,
                       moe_intermediate_size=32, experts_per_token=2)
    par = ParallelConfig(expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    experts_here = 4 * 8 * 3 * 64 * 32 // ep  # 4 layers x 8 experts x (gate, up, down of 64 x 32) / EP
    # the rest, whole on every device (TP1, PP1): embedding and untied head (256 x 64 each), per layer q/k/v/o
    # (4 x 64 x 64), 2 norms and the router (64 x 8), the final norm
    p = 2 * 256 * 64 + 4 * (4 * 64 * 64 + 2 * 64 + 64 * 8) + 64 + experts_here
    assert params_per_device(shape, par, divisible_by=128) == p
    mem = trained_memory(shape, par, dp=dp, dtype="bfloat16", distributed_optimizer=True, divisible_by=128)
    assert mem.optimizer == int((p - experts_here) * 12 / dp + experts_here * 12 / edp)
