"""DeepSeek-V3 in the embedded engine (transformers' forward: MLA's latent cache in the preallocated running
set, keys = the kv_lora_rank latent, values = the rotated shared key): batched greedy generation equals
transformers' ``generate`` per prompt; the routed experts it returns are the ones an independent formula picks
from transformers' router logits (sigmoid + score-correction bias, top-2-sum group choice, top-k); a weight
update by checkpoint names, the router's ``e_score_correction_bias`` buffer included, gives the logits of the
model loaded from those weights."""
from __future__ import annotations

import base64
import threading

import numpy as np
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from mrl.rollout.engine.server import Engine, build_app
from tests.helpers.tiny_deepseek import make_tiny_deepseek_hf, reference_routing

PROMPTS = [[5, 17, 33, 41, 7, 9], [11, 3, 70]]
NEW = 10


def _decode(s: str, layers: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.int32).copy()).view(-1, layers, k)


def test_engine_generates_like_transformers_and_returns_deepseek_routing(tmp_path):
    import transformers as tf

    path = make_tiny_deepseek_hf(tmp_path / "m", seed=3)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), enable_return_routed_experts=True)
    assert engine.runner.decode_path.startswith("transformers forward")
    cfg = model.config
    greedy = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    with TestClient(build_app(engine)) as c:
        outs: dict[int, dict] = {}
        # both requests run in one batch (left-padded prefill, decode over the shared running set)
        threads = [threading.Thread(target=lambda i=i: outs.update({i: c.post("/generate", json={
            "input_ids": PROMPTS[i], "sampling_params": greedy, "return_routed_experts": True}).json()}))
            for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for i, prompt in enumerate(PROMPTS):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        assert outs[i]["output_ids"] == want[0, len(prompt):].tolist(), i
        tokens = prompt + outs[i]["output_ids"]
        got = _decode(outs[i]["meta_info"]["routed_experts"], cfg.num_hidden_layers, cfg.num_experts_per_tok)
        oracle = reference_routing(model, torch.tensor([tokens[:-1]]))[0]
        assert torch.equal(got.sort(-1).values, oracle), i
        assert (oracle[:, 0] == 0).all() and oracle[:, 1:].max() > 0  # layer 0 dense, the others routed


def test_weight_update_includes_the_score_correction_bias(tmp_path):
    import transformers as tf

    a, b = make_tiny_deepseek_hf(tmp_path / "a", seed=0), make_tiny_deepseek_hf(tmp_path / "b", seed=1)
    src = load_file(str(b / "model.safetensors"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    ref_model = tf.AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.stack([ref_model(input_ids=torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    engine = Engine(str(a))
    with TestClient(build_app(engine)) as c:
        assert c.post("/update_weights_from_disk", json={"model_path": str(b)}).json()["success"]
        views = engine.runner.named_weights()
        assert set(views) == set(src) and bias in views
        assert all(torch.equal(views[n], t) for n, t in src.items())
        with engine.scheduler.model_lock:
            logits = engine.runner.prefill(PROMPTS)[1]
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
