"""DeepSeek-V3.2 and GLM-5 (DeepSeek sparse attention) in the embedded engine: transformers' forward over the running
set, whose values carry the lightning indexer's keys beside MLA's rotated shared key. Two prompts of different
lengths run as one batch (a left-padded prefill, then decode steps over the shared running set, rows growing past
``index_topk`` = 4 so every step's top-k leaves tokens out); the engine's logits at every generated position equal
transformers' float64 forward of the final sequence alone (no cache) within twice transformers' own float32 error
(the parity test's bound), where every top-k choice of that sequence is far from a tie; weight updates by HF name
reach the indexer; the routed experts it returns are transformers' choice."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mrl.rollout.engine.model_runner import ModelRunner
from tests.helpers.tiny_dsa import make_tiny_dsa_hf, reference
from tests.megatron.test_dsa_parity import MIN_GAP, tol

PROMPTS = [[5, 17, 33, 41, 7, 9], [11, 3, 70]]
NEW = 10


@pytest.mark.parametrize("kind", ["deepseek_v32", "glm_moe_dsa"])
def test_engine_logits_match_transformers(tmp_path, kind):
    path = make_tiny_dsa_hf(tmp_path / kind, kind, seed=4)
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
    refs = reference(path, [torch.tensor([p + o]) for p, o in zip(PROMPTS, out)])
    for i, (prompt, ref) in enumerate(zip(PROMPTS, refs)):
        assert ref["gap"] >= MIN_GAP, ref["gap"]
        got = torch.stack([s[i] for s in steps]).double()
        diff = (got - ref["logits"][0, len(prompt) - 1: -1]).abs().max().item()
        assert diff <= tol(ref["err32"]), (i, diff, ref["err32"])


def test_engine_returns_the_routed_experts(tmp_path):
    """Routing replay's input: the engine's captured expert ids of a prefill (``routing=True``) are the ones an
    independent formula picks from transformers' router logits (tests/helpers/tiny_deepseek.py), layer 0 dense."""
    import transformers as tf

    from tests.helpers.tiny_deepseek import reference_routing

    path = make_tiny_dsa_hf(tmp_path / "m", "deepseek_v32", seed=2)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(str(path), capture_routing=True)
    prompt = PROMPTS[0] + PROMPTS[1]
    with torch.inference_mode():
        runner.prefill([prompt], routing=True)
    oracle = reference_routing(model, torch.tensor([prompt]))[0]
    assert torch.equal(runner.last_routing[0].sort(-1).values.to(oracle.dtype), oracle)
    assert (oracle[:, 0] == 0).all() and oracle[:, 1:].max() > 0
