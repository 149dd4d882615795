"""``python -m mrl.quickstarts base`` writes a loadable tiny Qwen2, warm-started to its target accuracy, a
round-tripping tokenizer and arith data that ``mrl plan mrl_configs/quickstart.yaml`` accepts;
deterministic and idempotent."""
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mrl.quickstarts import base as qs
from mrl.quickstarts.cli import main as quickstarts_main
from tests.helpers.e2e import write_warm_assets

ROOT = Path(__file__).resolve().parents[2]


def _digest(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    # the session's one warm-started build (tests/helpers/e2e.py), as `python -m mrl.quickstarts base` writes it;
    # test_deterministic_and_idempotent builds it again through the CLI and compares the bytes
    return write_warm_assets(tmp_path_factory.mktemp("qs") / "quickstart")


def test_model_and_tokenizer_load_with_transformers(assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets / qs.MODEL_DIR
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    c = model.config
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.tie_word_embeddings) == ("qwen2", 300, 64, 4, 4, 2, True)
    assert len(tok) == 300 and (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    prompts = [p for p, _ in qs.problems()]
    for p in prompts[::7] + ["héllo wörld ∑ 42\n"]:  # byte-level: any text round-trips
        assert tok.decode(tok(p)["input_ids"]) == p
    ids = tok(prompts[0], return_tensors="pt")["input_ids"]
    assert ids.shape[1] < 20  # merges learnt on the corpus compress the prompts
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 300) and torch.isfinite(logits).all()


def test_warm_start_leaves_room_for_rl(assets):
    """The shipped model answers at least WARM_START_TARGET of the problems greedily, as the trainer
    tokenizes them (digits split), but is far from solving the task: GRPO has signal and headroom.
    Upper bound: the warm start's sudden jump overshot to 0.52 at most in the seeds we ran."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets / qs.MODEL_DIR
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_ids_to_tokens(tok(" 17")["input_ids"]) == ["Ġ", "1", "7"]
    acc = qs.greedy_accuracy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tok)
    assert qs.WARM_START_TARGET <= acc <= 0.6


def test_data_is_graded_by_arith_and_fits_the_quickstart_limits(assets):
    from transformers import AutoTokenizer

    from mrl.data.dataset import PromptDataset, read_rows
    from mrl.rewards import RewardManager

    train, val = read_rows(assets / "data/train.jsonl"), read_rows(assets / "data/val.jsonl")
    assert (len(train), len(val)) == (100, 100)
    # 100 problems are too few to hold any out: val is the train set, shuffled the same way
    assert [r["prompt"] for r in train] == [r["prompt"] for r in val] != [p for p, _ in qs.problems()]
    assert {r["prompt"] for r in train} == {p for p, _ in qs.problems()}
    tok = AutoTokenizer.from_pretrained(assets / qs.MODEL_DIR)
    ds = PromptDataset([assets / "data/train.jsonl"], tok, max_prompt_length=64, filter_overlong_prompts=False)
    assert len(ds) == 100
    rm = RewardManager("arith")
    gts = [p.ground_truth for p in ds.prompts[:50]]
    assert rm([f" {g}</s>" for g in gts], gts).scores.eq(1.0).all()
    assert rm([f" {int(g) + 1}" for g in gts], gts).scores.eq(0.0).all()


def test_mrl_plan_accepts_the_assets(assets):
    r = subprocess.run(
        [sys.executable, "-m", "mrl", "plan", str(ROOT / "mrl_configs/quickstart.yaml"),
         f"model.path={assets / qs.MODEL_DIR}", f"data.train_files=[{assets / 'data/train.jsonl'}]"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # The plan read the checkpoint's config.json: 0.2M parameters, fp32 weights of 0.7 MiB.
    assert "model 0.2M params, float32" in r.stdout and "weights 0.7 MiB" in r.stdout


def test_deterministic_and_idempotent(assets, tmp_path, capsys):
    other = tmp_path / "again"
    assert quickstarts_main(["base", "--out", str(other)]) == 0  # the warm start included: same seed, same bytes
    assert "written" in capsys.readouterr().out
    assert _digest(other) == _digest(assets)
    before = {p: p.stat().st_mtime_ns for p in other.rglob("*") if p.is_file()}
    assert quickstarts_main(["base", "--out", str(other)]) == 0
    assert "kept" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in other.rglob("*") if p.is_file()} == before
    qs.write_assets(other, seed=1, force=True, warm_start_steps=0)  # the seed alone changes the init
    assert _digest(other)[f"{qs.MODEL_DIR}/model.safetensors"] != \
        _digest(assets)[f"{qs.MODEL_DIR}/model.safetensors"]
