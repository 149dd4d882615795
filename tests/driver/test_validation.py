"""The validation phase: sampling params from rollout.val_kwargs, chunking, the logged rows, and
``run_validation`` against a real embedded engine process (quickstart's tiny Qwen2 + tokenizer)."""
from __future__ import annotations

import json

import pytest

from mrl.config import RolloutConfig
from mrl.driver.validation import (
    pick_generations,
    prompt_chunks,
    run_validation,
    val_sampling_params,
)
from mrl.observability.val_metrics import prompt_metrics


def test_sampling_params_greedy_unless_do_sample():
    greedy = RolloutConfig().val_kwargs  # verl's defaults: do_sample false, temperature 0, n 1
    assert (greedy.do_sample, greedy.temperature, greedy.n, greedy.top_p, greedy.top_k) == (False, 0.0, 1, 1.0, -1)
    assert val_sampling_params(greedy, 32) == {"temperature": 0.0, "max_new_tokens": 32}
    vk = RolloutConfig(val_kwargs={"do_sample": True, "n": 4, "temperature": 0.6, "top_p": 0.95, "top_k": 20}).val_kwargs
    assert val_sampling_params(vk, 16) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 16}


def test_prompt_chunks():
    assert prompt_chunks(7, None) == [range(7)]
    assert prompt_chunks(7, 3) == [range(3), range(3, 6), range(6, 7)]
    assert prompt_chunks(6, 3) == [range(3), range(3, 6)]
    assert prompt_chunks(0, None) == []


def test_pick_generations_is_fixed_whatever_the_order():
    inputs, outputs, scores = [f"q{i}" for i in range(10)], [f"a{i}" for i in range(10)], [i / 10 for i in range(10)]
    rows = pick_generations(inputs, outputs, scores, 4)
    assert len(rows) == 4 and len({r["input"] for r in rows}) == 4
    assert all(r["output"] == "a" + r["input"][1:] and r["score"] == int(r["input"][1:]) / 10 for r in rows)
    rev = pick_generations(inputs[::-1], outputs[::-1], scores[::-1], 4)
    assert rev == rows  # sorted by input before the seeded shuffle, as verl
    assert len(pick_generations(inputs, outputs, scores, 50)) == 10 and pick_generations(inputs, outputs, scores, 0) == []


# ---- against a real engine --------------------------------------------------------------------

def _length_score(solution_str: str, ground_truth: str, **kw) -> float:
    """A scorer with spread on a random tiny model (arith would score ~all 0): length mod 7, in [0, 1]."""
    return (len(solution_str) % 7) / 6


_SCORED: list[str] = []  # responses in the order _vote_score saw them (in-process scoring)


def _vote_score(solution_str: str, ground_truth: str, **kw) -> dict:
    """verl-style dict scorer with spread on a random model: the 'answer' is the length mod 3."""
    _SCORED.append(solution_str)
    pred = str(len(solution_str) % 3)
    return {"score": (len(solution_str) % 7) / 6, "acc": pred == "0", "pred": pred}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from mrl.data.dataset import PromptDataset
    from mrl.quickstarts.base import write_assets
    from mrl.rewards import RewardManager
    from mrl.rollout.client import RolloutClient
    from mrl.rollout.pool import EngineEndpoint, EnginePool
    from mrl.rollout.router import Router
    from mrl.rollout.sglang_launcher import EngineProcess, build_embedded_command
    from tests.helpers.dist import free_port

    tmp = tmp_path_factory.mktemp("val")
    write_assets(tmp / "assets", n_val=20, warm_start_steps=0)  # a random model: its answers spread
    model = str(tmp / "assets" / "tiny-qwen2")
    rows = [json.loads(x) for x in (tmp / "assets" / "data" / "val.jsonl").read_text().splitlines()][:10]
    for r in rows[5:]:
        r["data_source"] = "other"  # two sources: metrics are grouped per data_source
    val = tmp / "val.jsonl"
    val.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok = AutoTokenizer.from_pretrained(model)
    ds = PromptDataset([val], tok, max_prompt_length=64, config_key="data.val_files")
    port = free_port()
    eng = EngineProcess(build_embedded_command(model, port), f"http://127.0.0.1:{port}", tmp / "engine.log",
                        env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=180)
    eng.start(wait=True)
    pool = EnginePool([EngineEndpoint(eng.url, eng.restart)], health_interval_s=0)
    try:
        yield RolloutClient(Router(pool)), tok, ds, RewardManager(_length_score)
    finally:
        pool.close()
        eng.stop()


def _validate(setup, log_generations: int, val_batch_size: int | None = None, seed=None, **val_kwargs):
    client, tok, ds, reward = setup
    rollout = RolloutConfig(max_response_length=12, val_kwargs=val_kwargs)
    return run_validation(generate=client.generate, tokenizer=tok, dataset=ds, reward=reward, rollout=rollout,
                          val_batch_size=val_batch_size, log_generations=log_generations, seed=seed)


@pytest.mark.slow
def test_sampled_validation_is_reproducible_with_a_seed(setup):
    kw = {"do_sample": True, "n": 2, "temperature": 1.0}
    a = _validate(setup, 20, 4, seed=(7, 3), **kw)
    assert a.generations == _validate(setup, 20, 10, seed=(7, 3), **kw).generations  # chunking does not matter
    assert a.metrics == _validate(setup, 20, 4, seed=(7, 3), **kw).metrics
    assert a.generations != _validate(setup, 20, 4, seed=(7, 4), **kw).generations  # the step enters the seed


@pytest.mark.slow
def test_greedy_default_is_deterministic_mean_at_1(setup):
    a = _validate(setup, log_generations=10)
    assert set(a.metrics) == {"val-core/arith/reward/mean@1", "val-core/other/reward/mean@1"}
    assert (a.num_prompts, a.num_samples, len(a.generations)) == (10, 10, 10)
    b = _validate(setup, log_generations=10)
    assert a.generations == b.generations and a.metrics == b.metrics  # greedy: same answers twice
    arith = set(_arith_inputs(setup))
    scores = [r["score"] for r in a.generations if r["input"] in arith]
    assert len(scores) == 5
    assert a.metrics["val-core/arith/reward/mean@1"] == pytest.approx(sum(scores) / 5, abs=1e-6)


def _arith_inputs(setup):
    _, tok, ds, _ = setup
    return [tok.decode(ds[i].prompt_ids, skip_special_tokens=True) for i in range(len(ds)) if ds[i].data_source == "arith"]


@pytest.mark.slow
def test_sampled_n2_in_chunks_gives_verl_metrics(setup):
    res = _validate(setup, log_generations=20, val_batch_size=4, do_sample=True, n=2, temperature=1.0)
    assert (res.num_prompts, res.num_samples, len(res.generations)) == (10, 20, 20)
    for src in ("arith", "other"):
        assert {k.split(f"/{src}/reward/")[1] for k in res.metrics if f"/{src}/" in k} == {
            "mean@2", "std@2", "best@2/mean", "best@2/std", "worst@2/mean", "worst@2/std"}
        assert f"val-core/{src}/reward/mean@2" in res.metrics and f"val-core/{src}/reward/best@2/mean" in res.metrics
        assert f"val-aux/{src}/reward/worst@2/mean" in res.metrics and f"val-aux/{src}/reward/std@2" in res.metrics
    # Recompute from the logged rows (all 20): group the two answers of each prompt by its text.
    arith = set(_arith_inputs(setup))
    groups: dict[str, list[float]] = {}
    for r in res.generations:
        groups.setdefault(r["input"], []).append(r["score"])
    assert len(groups) == 10 and all(len(v) == 2 for v in groups.values())
    assert len({r["score"] for r in res.generations}) > 1  # the scorer spreads, so best/worst/std mean something
    per_prompt = [v for k, v in groups.items() if k in arith]
    assert len(per_prompt) == 5
    for name in ("mean@2", "std@2"):  # exact: order-free
        sec = "val-aux" if name.startswith("std") else "val-core"
        want = sum(prompt_metrics(v)[name] for v in per_prompt) / 5
        assert res.metrics[f"{sec}/arith/reward/{name}"] == pytest.approx(want, abs=1e-6), name
    # best@2/worst@2 are bootstraps over positions and the logged rows are shuffled, so compare with
    # the exact expectation over the 4 draws (x1,x1) (x1,x2) (x2,x1) (x2,x2): E[max] = (x1 + x2 + 2·max)/4.
    # Scores lie in [0, 1], so each prompt's estimate has std error <= 0.5/sqrt(1000) = 0.016: 4 of them = 0.063.
    best = sum((a + b + 2 * max(a, b)) / 4 for a, b in per_prompt) / 5
    worst = sum((a + b + 2 * min(a, b)) / 4 for a, b in per_prompt) / 5
    assert res.metrics["val-core/arith/reward/best@2/mean"] == pytest.approx(best, abs=0.063)
    assert res.metrics["val-aux/arith/reward/worst@2/mean"] == pytest.approx(worst, abs=0.063)
    # sampling at temperature 1 on a random model: some prompt gets two different answers
    outs: dict[str, set[str]] = {}
    for r in res.generations:
        outs.setdefault(r["input"], set()).add(r["output"])
    assert any(len(v) == 2 for v in outs.values())
    assert res.metrics["val-core/arith/reward/best@2/mean"] >= res.metrics["val-core/arith/reward/mean@2"] - 1e-9
    assert res.metrics["val-aux/arith/reward/worst@2/mean"] <= res.metrics["val-core/arith/reward/mean@2"] + 1e-9


@pytest.mark.slow
def test_dict_scorer_acc_is_core_and_pred_votes(setup):
    """reward_extra_info end to end: chunks joined, acc the val-core variable, maj@k from pred."""
    from mrl.rewards import RewardManager

    client, tok, ds, _ = setup
    _SCORED.clear()
    n = 4
    res = _validate((client, tok, ds, RewardManager(_vote_score)), log_generations=0, val_batch_size=4,
                    do_sample=True, n=n, temperature=1.0)
    assert (res.num_prompts, res.num_samples, len(_SCORED)) == (10, 40, 40)
    for src in ("arith", "other"):
        assert {k for k in res.metrics if k.startswith(f"val-core/{src}/")} == {
            f"val-core/{src}/acc/{m}" for m in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std")}
        for var in ("reward", "score"):  # verl keeps "score" in reward_extra_info as well
            assert f"val-aux/{src}/{var}/maj@4/mean" in res.metrics and f"val-aux/{src}/{var}/mean@4" in res.metrics
    assert not any("/pred/" in k for k in res.metrics)
    # Recompute from the responses in scoring order (sample s answers dataset row s // n): the same
    # seeded draws, so the driver's plumbing (chunks, uids, pred alignment) must match exactly.
    preds = [str(len(t) % 3) for t in _SCORED]
    acc = [float(p == "0") for p in preds]
    assert 0 < sum(acc) < 40 and len(set(preds)) > 1  # spread: the vote and the means mean something
    for src in ("arith", "other"):
        rows = [i for i in range(10) if ds[i].data_source == src]
        per = [prompt_metrics(acc[i * n:(i + 1) * n], preds[i * n:(i + 1) * n]) for i in rows]
        for name in ("mean@4", "maj@4/mean", "maj@2/mean", "best@4/mean"):
            sec = "val-aux" if name == "maj@2/mean" else "val-core"
            assert res.metrics[f"{sec}/{src}/acc/{name}"] == pytest.approx(sum(p[name] for p in per) / len(per),
                                                                         abs=1e-9), (src, name)


@pytest.mark.slow
def test_rm_verdict_is_compared_with_the_rule_on_val(setup):
    """With an RM and a function reporting ``acc``: per answer, whether σ(rm_score) > 0.5 agrees with
    the rule (rm_rule_agree), whether the RM accepts a rule-wrong answer (rm_fooled) and what a
    rule-wrong answer earns (rm_wrong_prob)."""
    import torch

    from mrl.rewards import RewardManager

    client, tok, ds, _ = setup

    from mrl.driver.rm_reward import RewardModelInputs, RewardModelScorer

    def rm(batch):  # a scorer with spread on a random model: +1 for even response lengths
        return torch.tensor([1.0 if int(n) % 2 == 0 else -1.0 for n in batch.response_mask.sum(-1)])

    rollout = RolloutConfig(max_response_length=12, val_kwargs={"do_sample": True, "n": 2, "temperature": 1.0})
    res = run_validation(generate=client.generate, tokenizer=tok, dataset=ds, reward=RewardManager(_vote_score),
                         rollout=rollout, val_batch_size=4, keep_samples=True, seed=(1, 0),
                         scorer=RewardModelScorer(rm, RewardModelInputs(None), "function"))
    x = res.samples.extra
    agree = [float((r > 0) == (a >= 0.5)) for r, a in zip(x["rm_score"], x["acc"], strict=True)]
    fooled = [float(r > 0 and a < 0.5) for r, a in zip(x["rm_score"], x["acc"], strict=True)]
    assert x["rm_rule_agree"] == agree and x["rm_fooled"] == fooled
    assert x["rm_wrong_prob"] == pytest.approx([0.0 if a >= 0.5 else float(torch.sigmoid(torch.tensor(r)))
                                                for r, a in zip(x["rm_score"], x["acc"], strict=True)])
    assert 0 < sum(agree) < len(agree)  # spread: the comparison means something
    arith = [i for i in range(res.num_samples) if ds[i // 2].data_source == "arith"]
    assert res.metrics["val-aux/arith/rm_fooled/mean@2"] == pytest.approx(sum(fooled[i] for i in arith) / len(arith))
