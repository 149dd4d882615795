"""The agent loop against a real embedded engine (the agent quickstart's warm-started tiny model):
token-in/token-out trajectories, masks, the trainer-side log-probs of every sampled token across
turns, and no decode -> encode of the model's text (docs/agent.md, "Tokens")."""
from __future__ import annotations

import pytest
import torch

from mrl.agent.template import tool_segment_ids
from mrl.agent.tools import load_tools
from mrl.config.agent import AgentConfig
from mrl.data.dataset import PromptBatch
from mrl.data.tokenize import encode_prompt, left_pad, position_ids_from_mask
from mrl.driver.batch import assemble_train_batch
from mrl.rollout.types import RolloutRequest
from tests.helpers.e2e import write_agent_assets

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the warm start is CPU-bound: slow on a loaded host


class SpyTokenizer:
    """The real tokenizer, recording every text it is asked to encode."""

    def __init__(self, tok) -> None:
        self._tok, self.encoded = tok, []

    def __call__(self, text, *a, **kw):
        self.encoded.append(text)
        return self._tok(text, *a, **kw)

    def encode(self, text, *a, **kw):
        self.encoded.append(text)
        return self._tok.encode(text, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrl.agent.loop import AgentClient
    from mrl.quickstarts.agent import (
        MODEL_DIR,
        messages,
        problems,
        tools_schemas,
    )
    from mrl.rollout.client import RolloutClient
    from mrl.rollout.pool import EngineEndpoint, EnginePool
    from mrl.rollout.router import Router
    from mrl.rollout.sglang_launcher import EngineProcess, build_embedded_command
    from tests.helpers.dist import free_port

    tmp = write_agent_assets(tmp_path_factory.mktemp("agent") / "assets")
    model = str(tmp / MODEL_DIR)
    tok = AutoTokenizer.from_pretrained(model)
    port = free_port()
    eng = EngineProcess(build_embedded_command(model, port), f"http://127.0.0.1:{port}", tmp / "engine.log",
                        env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=300)
    eng.start(wait=True)
    pool = EnginePool([EngineEndpoint(eng.url, eng.restart)], health_interval_s=0)
    spy = SpyTokenizer(tok)
    _, val = problems(0)
    prompts = [encode_prompt(tok, messages(a, b), tools_schemas()) for a, b in val[:4]]

    def client(**cfg):
        return AgentClient(RolloutClient(Router(pool)), spy, load_tools(["calculator"]), AgentConfig(enable=True, **cfg))
    try:
        yield client, spy, tok, prompts, AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    finally:
        pool.close()
        eng.stop()


def _request(prompts, max_new_tokens=64, n=8):
    return RolloutRequest(prompts, n=n, sampling_params={"temperature": 1.0, "max_new_tokens": max_new_tokens},
                          sampling_seeds=[[100 * i + j for j in range(n)] for i in range(len(prompts))])


def test_trajectories_are_token_exact_across_turns(setup):
    make, spy, tok, prompts, hf = setup
    ac = make()
    try:
        spy.encoded.clear()
        res = ac.generate(_request(prompts))
    finally:
        ac.close()
    assert not res.failed
    multi = [s for s in res.samples if s.agent["turns"] > 1]
    assert multi, "no sample called a tool: the warm start did not teach the call format"
    for s in res.samples:
        ids, mask = s.response_ids, s.loss_mask
        assert len(mask) == len(ids) == len(s.rollout_log_probs) <= 64
        # the masked runs are exactly the chat-template segments of the tool results, turn by turn
        runs, k = [], 0
        while k < len(ids):
            j = k
            while j < len(ids) and mask[j] == mask[k]:
                j += 1
            runs.append((mask[k], ids[k:j], k))
            k = j
        tool_runs = [r for r in runs if r[0] == 0]
        # one segment per turn whose calls ran (the last one may be cut short, or to nothing, by the budget)
        call_turns = len({c["turn"] for c in s.agent["tool_calls"]})
        assert len(tool_runs) == call_turns or (s.agent["stop"] == "length" and len(tool_runs) == call_turns - 1)
        for t, (_, seg, start) in enumerate(tool_runs, start=1):
            results = [c["result"] for c in s.agent["tool_calls"] if c["turn"] == t]
            want = tool_segment_ids(tok, results, ids[start - 1])
            assert seg == want[:len(seg)]
            assert all(lp == 0.0 for lp in s.rollout_log_probs[start:start + len(seg)])
    # the model's text was decoded (to find calls) but never encoded again: every encoded text is a
    # template segment, which holds no model turn's text
    model_texts = [tok.decode(s.response_ids[:s.loss_mask.index(0)], skip_special_tokens=True) for s in multi]
    assert spy.encoded and all(mt.strip() not in e for e in spy.encoded for mt in model_texts if len(mt.strip()) > 8)

    # the trainer's view: the assembled batch, one forward of the policy -> log-probs of every sampled token
    P = max(map(len, prompts))
    ids, pmask = left_pad(prompts, tok.pad_token_id, P)
    batch = assemble_train_batch(PromptBatch(ids, pmask, position_ids_from_mask(pmask), []), res,
                                 pad_token_id=tok.pad_token_id, uids=list(range(len(prompts))))
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids).logits.float()
    R = batch.responses.shape[1]
    lp = torch.log_softmax(logits[:, P - 1:P - 1 + R], -1).gather(-1, batch.responses[:, :, None])[..., 0]
    m = batch.response_mask.bool()
    assert int(m.sum()) < int(batch.attention_mask[:, P:].sum())  # tool tokens: attended, not trained
    diff = (lp - batch.rollout_log_probs)[m].abs().max().item()
    assert diff <= 1e-5, diff


def test_budget_and_max_turns_end_trajectories(setup):
    make, _, _, prompts, _ = setup
    one = make(max_turns=1)
    try:
        res = one.generate(_request(prompts[:2], n=4))
    finally:
        one.close()
    for s in res.samples:  # a call in the only turn is not run
        assert s.agent["turns"] == 1 and s.agent["tool_calls"] == [] and all(s.loss_mask)
    assert any(s.agent["stop"] == "max_turns" for s in res.samples)
    ac = make()
    try:
        short = ac.generate(_request(prompts[:2], max_new_tokens=34, n=4))
    finally:
        ac.close()
    for s in short.samples:
        assert len(s.response_ids) <= 34
        if s.agent["stop"] == "length":
            assert s.finish_reason == "length"
