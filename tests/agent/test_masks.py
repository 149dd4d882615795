"""Multi-turn samples through the batch: tool tokens are attended but masked out of the loss, the
metrics and the advantages; rewards see the agent record; row tool kwargs reach the loop."""
import torch

from mrl.agent.loop import agent_metrics, row_tool_kwargs
from mrl.algorithms import get_adv_estimator
from mrl.data.dataset import Prompt, PromptBatch
from mrl.data.tokenize import left_pad, position_ids_from_mask
from mrl.driver.batch import (
    assemble_train_batch,
    repeat_prompts,
    tools_kwargs_of,
    with_agent_info,
)
from mrl.observability.data_metrics import compute_data_metrics
from mrl.rewards.manager import place_on_last_token
from mrl.rollout.types import RolloutResult, RolloutSample


def _agent(turns, calls, errors=0, timeouts=0, stop="answer"):
    return {"turns": turns, "tool_calls": [{"turn": 1, "name": "calculator"}] * calls, "final_response": "7",
            "stop": stop, "tool_errors": errors, "tool_timeouts": timeouts}


def _result():
    # sample 0: model 3 tokens, tool segment 2 tokens, model 2 tokens; sample 1: one model turn of 2 tokens
    a = RolloutSample(0, 0, [5, 6], [10, 11, 12, 90, 91, 13, 2], [-.1, -.2, -.3, 0., 0., -.4, -.5], "stop", "0",
                      loss_mask=[1, 1, 1, 0, 0, 1, 1], agent=_agent(2, 1, errors=1, timeouts=1))
    b = RolloutSample(0, 1, [5, 6], [14, 2], [-.6, -.7], "stop", "0", loss_mask=[1, 1], agent=_agent(1, 0))
    return RolloutResult([a, b], n=2)


def test_tool_tokens_are_attended_but_not_trained():
    res = _result()
    ids, mask = left_pad([[5, 6]], 0, 3)
    batch = assemble_train_batch(PromptBatch(ids, mask, position_ids_from_mask(mask), []), res, pad_token_id=0, uids=[7])
    assert batch.responses.tolist() == [[10, 11, 12, 90, 91, 13, 2], [14, 2, 0, 0, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]]
    assert batch.attention_mask[:, 3:].tolist() == [[1] * 7, [1, 1, 0, 0, 0, 0, 0]]
    assert batch.position_ids[0].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]  # contiguous over the turns
    m = compute_data_metrics(response_mask=batch.response_mask, max_response_length=7)
    assert m["response_length/max"] == 5.0 and m["response_length/mean"] == 3.5  # the model's own tokens
    scores = place_on_last_token(torch.tensor([1.0, 0.0]), batch.response_mask)
    assert scores[0].tolist() == [0, 0, 0, 0, 0, 0, 1.0]
    adv, _ = get_adv_estimator("grpo")(scores, batch.response_mask.float(), index=batch.uid)
    assert (adv[0, 3:5] == 0).all() and (adv[0, :3] > 0).all() and (adv[1, :2] < 0).all()


def test_agent_record_reaches_the_reward_and_metrics():
    res = _result()
    p = Prompt([5, 6], [{"role": "user", "content": "q"}], "7", "src",
               {"index": 3, "tools_kwargs": {"calculator": {"create_kwargs": {"a": 1}, "execute_kwargs": {"b": 2}}}})
    rep = with_agent_info(repeat_prompts([p], 2), res)
    assert rep[0].extra_info["agent"]["turns"] == 2 and rep[1].extra_info["agent"]["turns"] == 1
    assert rep[0].extra_info["index"] == 3 and "agent" not in p.extra_info  # the dataset's prompt is not changed
    assert tools_kwargs_of([p]) == [p.extra_info["tools_kwargs"]] and tools_kwargs_of([Prompt([1], "x", "1")]) is None
    assert row_tool_kwargs(p.extra_info["tools_kwargs"], "calculator") == {"a": 1, "b": 2}
    assert row_tool_kwargs({"calculator": {"a": 1}}, "calculator") == {"a": 1} and row_tool_kwargs(None, "x") == {}
    m = agent_metrics(res)
    assert m["agent/turns/mean"] == 1.5 and m["agent/tool_calls/mean"] == 0.5
    assert m["agent/tool_errors"] == 1.0 and m["agent/tool_timeouts"] == 1.0
    assert agent_metrics(RolloutResult([RolloutSample(0, 0, [1], [2], [-1.0], "stop")], 1)) == {}


def test_every_estimator_treats_tool_tokens_as_absent():
    """A trajectory with tool tokens inside (mask 0) gets, on its model tokens, the advantages and
    returns of the same trajectory with the tool tokens removed, and 0 on them, for every estimator."""
    torch.manual_seed(0)
    B, T = 4, 9
    mask = torch.ones(B, T)
    mask[0, 3:5] = 0  # a tool segment inside sample 0
    mask[1, 2:6] = 0
    mask[2, 7:] = 0   # right padding
    lengths = mask.sum(-1).long()
    # the same samples with the masked tokens removed (left-aligned, right-padded)
    compact_mask = torch.zeros(B, T)
    for i in range(B):
        compact_mask[i, :lengths[i]] = 1
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0])
    rewards = place_on_last_token(scores, mask)
    compact_rewards = place_on_last_token(scores, compact_mask)
    values = torch.randn(B, T)
    compact_values = torch.zeros(B, T)
    for i in range(B):
        compact_values[i, :lengths[i]] = values[i][mask[i].bool()]
    kw = {"index": torch.tensor([0, 0, 1, 1]), "reward_baselines": torch.tensor([0.5, 0.5, 0.2, 0.2]),
          "gamma": 0.9, "lam": 0.8}
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gae"):
        fn = get_adv_estimator(name)
        adv, ret = fn(rewards, mask, values=values, **kw)
        cadv, cret = fn(compact_rewards, compact_mask, values=compact_values, **kw)
        for i in range(B):
            got, want = adv[i][mask[i].bool()], cadv[i][:lengths[i]]
            assert torch.allclose(got, want, atol=1e-6), (name, i, got, want)
            assert torch.allclose(ret[i][mask[i].bool()], cret[i][:lengths[i]], atol=1e-6), name
        assert (adv[mask == 0] == 0).all(), name
