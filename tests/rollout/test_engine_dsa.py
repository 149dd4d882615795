"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) in the embedded engine: transformers' forward over the running
set, whose values carry the lightning indexer's keys beside MLA's rotated shared key. Batched greedy generation
(two prompts of different lengths: a left-padded prefill, then decode steps over the shared running set, rows
growing past ``index_topk`` = 4 so every step's top-k leaves tokens out) equals transformers' ``generate`` of each
prompt alone, and the engine's logits at every generated position equal transformers' full forward of the final
sequence (no cache) within float32 rounding."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mrl.rollout.engine.model_runner import ModelRunner
from tests.helpers.tiny_dsa import make_tiny_dsa_hf

PROMPTS = [[5, 17, 33, 41, 7, 9], [11, 3, 70]]
NEW = 10
TOL = 1e-5  # fp32: the same forward, other cache layout and batch shape


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_engine_generates_like_transformers(tmp_path, kind):
    import transformers as tf

    path = make_tiny_dsa_hf(tmp_path / kind, kind, seed=4)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(str(path))
    assert runner.sparse and runner.decode_path.startswith("transformers forward")
    src = load_file(str(path / "model.safetensors"))  # weight updates by HF name reach the indexer too
    assert set(runner.named_weights()) == set(src) and any(".indexer." in n for n in src)
    rb = runner.new_batch()
    with torch.inference_mode():  # as the engine's scheduler runs the model
        rows, logits = runner.prefill(PROMPTS)
        steps = [logits]
        rb.add(rows, logits.argmax(-1))
        out = [[t] for t in logits.argmax(-1).tolist()]
        for _ in range(NEW - 1):
            logits = runner.decode(rb)
            steps.append(logits)
            rb.last_tokens = logits.argmax(-1)
            for o, t in zip(out, rb.last_tokens.tolist()):
                o.append(t)
        for i, prompt in enumerate(PROMPTS):
            want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            assert out[i] == want[0, len(prompt):].tolist(), i
            full = model(torch.tensor([prompt + out[i]])).logits[0, len(prompt) - 1: -1]
            got = torch.stack([s[i] for s in steps])
            assert (got - full).abs().max().item() <= TOL, i
