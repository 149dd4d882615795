"""The rollout client asks for routed experts and returns them per sample, shaped and aligned: against the
in-process engine (real HTTP, pool and router), checked against an unbatched transformers forward's router
top-k; answers without them (SGLang started without the flag) become failed samples that say why."""
from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from mrl.rollout.client import RolloutClient, _sample
from mrl.rollout.engine.in_process import InProcessEngine
from mrl.rollout.pool import EngineEndpoint, EnginePool
from mrl.rollout.router import RouteOutcome, Router
from mrl.rollout.types import FINISH_ERROR, RolloutRequest, RoutedExpertsLayout
from tests.helpers.dist import free_port
from tests.helpers.tiny_moe_checkpoints import (
    LAYERS,
    TOP_K,
    make_tiny_moe_hf,
    reference_topk,
)

PROMPTS = [[5, 17, 33, 41, 7, 9], [11, 3]]


def test_client_returns_routed_experts_per_sample(tmp_path):
    import transformers as tf

    path = make_tiny_moe_hf(tmp_path / "m", "qwen2_moe", seed=2)
    layout = RoutedExpertsLayout.from_hf_config(path)
    assert layout == RoutedExpertsLayout(LAYERS, TOP_K)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = InProcessEngine(str(path), host="127.0.0.1", port=free_port(), token=None, dtype="float32", seed=0,
                          enable_return_routed_experts=True)
    pool = EnginePool([EngineEndpoint(eng.url)], health_interval_s=0)
    try:
        client = RolloutClient(Router(pool), return_routed_experts=True, routed_experts_layout=layout)
        res = client.generate(RolloutRequest(PROMPTS, n=2, sampling_params={"temperature": 1.0, "max_new_tokens": 5,
                                                                            "ignore_eos": True}))
        plain = RolloutClient(Router(pool)).generate(RolloutRequest(PROMPTS[:1], sampling_params={"max_new_tokens": 2}))
    finally:
        pool.close()
        eng.stop()
    assert not res.failed and plain.samples[0].routed_experts is None  # default off
    for s in res.samples:
        tokens = s.prompt_ids + s.response_ids
        assert s.routed_experts.dtype == torch.int32
        assert s.routed_experts.shape == (len(tokens) - 1, LAYERS, TOP_K)
        assert torch.equal(s.routed_experts, reference_topk(model, tokens[:-1]))
    # aligned with the trainer's input_ids: prompt left-padded to 8 columns, responses right-padded
    padded = res.routed_experts_padded(prompt_width=8)
    assert padded.shape == (4, 8 + 5, LAYERS, TOP_K)
    s = res.samples[2]  # prompt 1 (2 tokens): columns 6, 7 are its prompt, 8..12 its response
    assert (padded[2, :6] == -1).all() and torch.equal(padded[2, 6:12], s.routed_experts)
    assert (padded[2, 12] == -1).all()  # the last response token was never fed to the engine


def test_missing_or_misshaped_routed_experts_fail_the_sample():
    out = RouteOutcome({}, None, 1, "http://e")
    layout = RoutedExpertsLayout(2, 2)
    body = {"output_ids": [4, 5], "meta_info": {"finish_reason": {"type": "length"}}}
    s = _sample(0, 0, [1, 2, 3], body, out, False, layout)
    assert s.finish_reason == FINISH_ERROR and "--enable-return-routed-experts" in s.error
    ok = base64.b64encode(np.arange(4 * 2 * 2, dtype=np.int32).tobytes()).decode()
    s = _sample(0, 0, [1, 2, 3], {**body, "meta_info": {"routed_experts": ok}}, out, False, layout)
    assert s.ok and s.routed_experts.shape == (4, 2, 2) and s.routed_experts[3, 1, 1] == 15
    short = base64.b64encode(np.arange(6, dtype=np.int32).tobytes()).decode()
    s = _sample(0, 0, [1, 2, 3], {**body, "meta_info": {"routed_experts": short}}, out, False, layout)
    assert s.finish_reason == FINISH_ERROR and "expected 4 tokens" in s.error
    aborted = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "paused"}}}
    s = _sample(0, 0, [1, 2, 3], aborted, out, False, layout)  # dropped before it ran: partial rollouts go on
    assert s.ok and s.finish_reason == "abort" and s.routed_experts is None
    with pytest.raises(ValueError, match="routed_experts_layout"):
        RolloutClient(None, return_routed_experts=True)  # type: ignore[arg-type]
