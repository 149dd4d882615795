"""``python -m mrl.quickstarts judge`` writes a causal LM on the actor's warm-started body and tokenizer
that answers " yes" to the right sum and " no" to wrong ones (re-measured here on the reloaded
checkpoint, and by greedy generation as the judge engine runs it); quickstart_judge.yaml renders the
prompt it was trained on."""
from pathlib import Path

import pytest
import torch
import yaml

from mrl.quickstarts import base as qs
from mrl.quickstarts import judge as qj
from mrl.quickstarts.cli import main as quickstarts_main
from mrl.rewards.judge import parse_verdict
from tests.helpers.e2e import write_warm_assets

ROOT = Path(__file__).resolve().parents[2]


def test_the_recipe_renders_the_prompt_the_judge_learnt() -> None:
    cfg = yaml.safe_load((ROOT / "mrl_configs" / "quickstart_judge.yaml").read_text())
    assert cfg["reward"]["judge"]["prompt_template"] == qj.TEMPLATE
    assert "{ground_truth}" not in qj.TEMPLATE  # the judge never sees the answer key


@pytest.mark.slow
def test_judge_says_yes_to_right_sums_and_no_to_wrong_ones(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = write_warm_assets(tmp_path / "quickstart")  # the actor's warm-started body (kept by the recipe)
    assert quickstarts_main(["judge", "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out / qj.JUDGE_DIR, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out / qj.JUDGE_DIR)
    right, wrong = qj.judge_accuracy(model, tok)
    assert right >= qj.JUDGE_TARGET and wrong >= qj.JUDGE_TARGET, (right, wrong)  # measured 1.000 / 1.000 (seed 0)
    # greedy decoding, as the judge engine answers: the verdict parses with the recipe's default pattern
    for response, verdict in ((" 7", 1.0), (" 8", 0.0), (" 77", 0.0), (" ", 0.0)):
        ids = torch.tensor([tok.encode(qj.TEMPLATE.format(prompt="question: what is 3 + 4 ? answer:", response=response))])
        with torch.no_grad():
            gen = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, eos_token_id=qs.QWEN2_SHAPE["eos_token_id"],
                                 pad_token_id=0)
        text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
        assert parse_verdict(text, scores={"yes": 1.0, "no": 0.0}) == verdict, (response, text)
    # an untrained judge (the actor's body) does not answer the question
    base = AutoModelForCausalLM.from_pretrained(out / qs.MODEL_DIR, dtype=torch.float32).eval()
    assert min(qj.judge_accuracy(base, tok)) < 0.9
    assert quickstarts_main(["judge", "--out", str(out)]) == 0  # present: kept


def test_a_judge_below_its_target_is_refused_unless_allowed(tmp_path: Path, capsys) -> None:
    out = tmp_path / "quickstart"
    qs.write_assets(out, warm_start_steps=0)  # kept by write_judge: a random actor body, fast
    judge = ["judge", "--out", str(out), "--seed", "3", "--max-steps", "1"]
    assert quickstarts_main(judge) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: judge --seed 3: below the 0.995 target after --max-steps=1 (1 steps;"), err
    assert "--allow-below-target" in err and "another --seed" in err
    assert not (out / qj.JUDGE_DIR).exists()  # nothing a policy could game was written
    status = qj.write_judge(out, seed=3, max_steps=1, allow_below_target=True)[str(out / qj.JUDGE_DIR)]
    assert status.startswith("written (1 steps;") and "WARNING: below the 0.995 target" in status
    assert (out / qj.JUDGE_DIR / "model.safetensors").is_file()


def test_the_hard_negatives_are_wrong_by_the_rule_and_seeded(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mrl.rewards.scorers import arith

    out = tmp_path / "quickstart"
    qs.write_assets(out, warm_start_steps=0)
    tok = AutoTokenizer.from_pretrained(out / qs.MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(out / qs.MODEL_DIR, dtype=torch.float32).eval()
    cases = qj.policy_negatives(model, tok, seed=0, samples=2)
    answers = dict(qs.problems())
    assert cases and all(not right and not arith(r, answers[p]) for p, r, right in cases)
    assert qj.policy_negatives(model, tok, seed=0, samples=2) == cases  # the same seed, the same samples
    acc = qj.accuracy_set()
    assert all(r == (c == f" {answers[p]}") for p, c, r in acc)  # right = exactly the sum (an extra may hit it)
    assert {p for p, _, r in acc if r} == set(answers)  # every problem's right sum is in the set


def test_verdict_margins_with_a_shared_prompt_equal_whole_sequence_logits(tmp_path: Path) -> None:
    """The checks score each case against its prompt's cached keys/values (``_margins``): the same
    logit(" yes") - logit(" no") as HF's forward over the whole sequence, to fp32 rounding, for cases that
    share the prompt's ids and for those scored whole (a response that merges into the prompt's last token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "quickstart"
    qs.write_assets(out, warm_start_steps=0)
    tok = AutoTokenizer.from_pretrained(out / qs.MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(out / qs.MODEL_DIR, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for w in model.parameters():  # HF's init gives near-equal logits: spread them so the margins differ
            w.add_(torch.randn_like(w) * 0.05)
    longer = [(f"question: what is {a} + 13 ? answer:", f" {a + 13}", True) for a in range(5)]  # another prompt length
    cases = qj.accuracy_set()[:280] + longer + [(p, r, False) for p, _ in qs.problems()[:5] for r in ("7", "", "  12")]
    y, n, k = qj._verdict_ids(tok)
    seqs = [tok.encode(qj.TEMPLATE.format(prompt=p, response=r), add_special_tokens=False) + y[:k] for p, r, _ in cases]
    assert len({len(tok.encode(p, add_special_tokens=False)) for p, _, _ in cases}) == 2  # both paths are taken
    with torch.no_grad():
        ref = torch.stack([model(input_ids=torch.tensor([s])).logits[0, -1] for s in seqs])
    ref = ref[:, y[k]] - ref[:, n[k]]
    got = qj._margins(model, tok, cases)
    assert ref.abs().max() > 0.1  # the margins are not trivially equal
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert qj._verdicts(model, tok, cases) == (ref > 0).tolist()
