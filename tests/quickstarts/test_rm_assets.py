"""``python -m mrl.quickstarts rm`` writes a one-label Qwen2 sequence classifier on the actor's
warm-started body and tokenizer that prefers correct sums (its pairwise and top-1 accuracy, and its
verifier probabilities, re-measured here on the reloaded checkpoint), keeps it when present, and ``mrl plan mrl_configs/quickstart_rm.yaml``
accepts the written assets and shows the RM's devices and memory."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mrl.quickstarts import base as qs
from mrl.quickstarts import rm as qrm
from mrl.quickstarts.cli import main as quickstarts_main
from tests.helpers.e2e import write_warm_assets

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = write_warm_assets(tmp_path_factory.mktemp("qs") / "quickstart")  # the actor's warm-started body
    assert quickstarts_main(["rm", "--out", str(out)]) == 0  # keeps the actor's assets, trains the RM
    return out


def test_rm_is_a_trained_sequence_classifier_sharing_the_actor_tokenizer(assets: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm_dir = assets / qrm.RM_DIR
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    assert rm.config.architectures == ["Qwen2ForSequenceClassification"] and rm.config.num_labels == 1
    tok, actor = AutoTokenizer.from_pretrained(rm_dir), AutoTokenizer.from_pretrained(assets / qs.MODEL_DIR)
    assert tok.get_vocab() == actor.get_vocab()  # the actor's tokenizer: same ids for every prompt and answer
    texts = [t for p, a in qs.problems() for t in (p, f" {a}", f" {int(a) + 1}")]
    assert [tok(t)["input_ids"] for t in texts] == [actor(t)["input_ids"] for t in texts]
    pairwise, top1 = qrm.rm_accuracy(rm, tok)
    assert pairwise >= qrm.RM_TARGET and top1 >= 0.9  # the right sum is its favourite (measured 0.999 / 0.99)
    # a verifier: sigmoid(score) is high on the right sum and low on every wrong one, on most problems
    with torch.no_grad():
        probs = [(torch.sigmoid(qrm._scores(rm, [p + ans for ans in answers])), a) for p, a, answers in qrm._encoded(tok)]
    right = torch.stack([pr[a] for pr, a in probs])
    wrong = torch.cat([torch.cat([pr[:a], pr[a + 1:]]) for pr, a in probs])
    assert right.mean() > 0.8 and wrong.mean() < 0.05
    # an untrained head (the training's start) prefers nothing: the accuracy is the training's work
    with torch.no_grad():
        rm.score.weight.zero_()
    assert qrm.rm_accuracy(rm, tok) == (0.0, 0.0)


def test_rewrite_is_skipped_when_present(assets: Path) -> None:
    status = qrm.write_rm(assets)
    assert status[str(assets / qrm.RM_DIR)] == "kept" and status[str(assets / qs.MODEL_DIR)] == "kept"


def test_score_with_acc_reports_the_rule_and_rewards_the_rm() -> None:
    # the reward is the verifier's probability sigmoid(rm_score); acc is the rule's verdict, not the RM's
    assert qrm.score_with_acc(" 7</s>", "7", "arith", {"rm_score": 0.0}) == {"score": 0.5, "acc": 1.0}
    out = qrm.score_with_acc(" 8", "7", "arith", {"rm_score": 2.0})
    assert out["acc"] == 0.0 and out["score"] == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert qrm.score_with_acc(" 8", "7", "arith", {"rm_score": -1e4})["score"] == 0.0  # no overflow
    assert qrm.score_with_acc(" 7", "7", "arith", {"rm_score": 1e4})["score"] == 1.0
    with pytest.raises(ValueError, match="needs extra_info\\['rm_score'\\]"):
        qrm.score_with_acc(" 7", "7", "arith", {})


def test_recipe_plans_on_the_written_assets(assets: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mrl", "plan", "mrl_configs/quickstart_rm.yaml", f"model.path={assets}/{qs.MODEL_DIR}",
         f"data.train_files=[{assets}/data/train.jsonl]", f"data.val_files=[{assets}/data/val.jsonl]",
         f"reward_model.model.path={assets}/{qrm.RM_DIR}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "reward_model    2 CPU ranks [node0:0-1] TP=1 PP=1 CP=1 DP=2; colocated with actor" in out.stdout
    assert "reward_model weights 0.7 MiB" in out.stdout
    assert "has no config.json" not in out.stdout  # the RM's config was read


def test_noisy_wrong_answers_are_wrong_by_the_rule_and_half_lack_eos() -> None:
    """The verifier's off-distribution negatives: every one is wrong by the arith rule (the RM is never
    taught to reject a right answer), half end with EOS and half stop as a cut response would."""
    import random

    from transformers import PreTrainedTokenizerFast

    from mrl.rewards.scorers import arith

    tok = PreTrainedTokenizerFast(tokenizer_object=qs.build_tokenizer())
    eos = qs.QWEN2_SHAPE["eos_token_id"]
    for a in (0, 9, 18):
        out = qrm._noisy_wrong(tok, a, random.Random(a))
        assert len(out) == qrm.LIST_NOISE
        assert [s[-1] == eos for s in out] == [i % 2 == 0 for i in range(qrm.LIST_NOISE)]
        assert not any(arith(tok.decode([t for t in s if t != eos]), str(a)) for s in out)
        assert all(0 < t < tok.vocab_size and t not in (0, 1) for s in out for t in s)


def test_verifier_scores_with_a_shared_prompt_equal_whole_sequence_scores() -> None:
    """The verifier step scores each prompt once and its candidates against its repeated keys/values
    (``_scores_per_prompt``): the same scores and gradients as the whole sequences, to fp32 rounding."""
    import random

    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForSequenceClassification,
    )

    tok = PreTrainedTokenizerFast(tokenizer_object=qs.build_tokenizer())
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(**qs.QWEN2_SHAPE, num_labels=1)).float()
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a zero head would score everything 0
    rng = random.Random(3)
    data = qrm._encoded(tok)
    batch = [rng.choice([d for d in data if len(d[0]) == len(data[0][0])]) for _ in range(4)]  # one prompt length
    cands = [answers + qrm._extra_wrong(tok, a, rng) + qrm._noisy_wrong(tok, a, rng) for _, a, answers in batch]

    whole = qrm._scores(model, [p + c for (p, _, _), cs in zip(batch, cands, strict=True) for c in cs]).view(4, -1)
    whole.square().sum().backward()
    g_whole = [w.grad.clone() for w in model.parameters()]
    model.zero_grad()
    shared = qrm._scores_per_prompt(model, [p for p, _, _ in batch], cands)
    shared.square().sum().backward()
    assert shared.shape == (4, 2 * qs.MAX_OPERAND + qrm.LIST_EXTRA + qrm.LIST_NOISE)
    assert whole.abs().max() > 1.0  # the scores are not trivially equal
    torch.testing.assert_close(shared, whole, rtol=0, atol=2e-5)
    rel = [((w.grad - g).norm() / g.norm()).item() for w, g in zip(model.parameters(), g_whole, strict=True)]
    assert max(rel) < 1e-5, rel  # each parameter's gradient, relative to its norm (measured: below 1e-6)
    with pytest.raises(ValueError, match="prompts of one length"):
        qrm._scores_per_prompt(model, [batch[0][0], batch[0][0][1:]], cands[:2])
    with pytest.raises(ValueError, match="the same number of candidates"):
        qrm._scores_per_prompt(model, [batch[0][0], batch[1][0]], [cands[0], cands[1][1:]])
