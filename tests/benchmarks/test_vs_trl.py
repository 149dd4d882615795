"""benchmarks/vs_trl.py's pieces that decide what the learning comparison compares (docs/vs_trl.md): the digit-sum
task's data and reward, its model (GQA, untied embeddings), mrl's settings against the ones TRL gets, and the
learning table's interval. No training, no TRL needed."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from mrl.config.loader import load_config
from mrl.rewards.scorers import arith

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vs_trl", REPO / "benchmarks" / "vs_trl.py")
vs_trl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_trl)


def test_digitsum_rows_and_reward() -> None:
    rows = vs_trl.problems(0, "digitsum")
    assert len(rows) == len({p for p, _ in rows}) == 10 ** vs_trl.DIGITS
    assert rows != sorted(rows) and sorted(rows) == sorted(vs_trl.problems(1, "digitsum"))  # a seed only reorders
    for prompt, answer in rows:
        digits = prompt.removesuffix("=")
        assert len(digits) == vs_trl.DIGITS and answer == str(sum(map(int, digits)) % 10)
    assert dict(rows)["47="] == "1" and dict(rows)["00="] == "0"
    assert arith(" 0</s>", "0") == 1.0 and arith("10", "0") == 0.0 and arith("7", "0") == 0.0
    assert ("3+4=", "7") in vs_trl.problems(0)  # the default task is unchanged
    with pytest.raises(ValueError, match="unknown task"):
        vs_trl.problems(0, "sort")


def test_digitsum_assets_gqa_untied(tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    model_dir, _, n_params = vs_trl.write_assets(tmp_path, "tiny", 3, steps=2, task="digitsum")
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (4, 2, False)
    w = load_file(str(model_dir / "model.safetensors"))
    assert w["lm_head.weight"].shape == w["model.embed_tokens.weight"].shape
    assert not (w["lm_head.weight"] == w["model.embed_tokens.weight"]).all()
    assert w["model.layers.0.self_attn.k_proj.weight"].shape[0] == w["model.layers.0.self_attn.q_proj.weight"].shape[0] // 2
    assert n_params == sum(t.numel() for t in w.values())
    assert AutoTokenizer.from_pretrained(str(model_dir))("472=")["input_ids"] == [8, 11, 6, 15]  # one token a char
    mrl_rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    trl_rows = [json.loads(x) for x in (tmp_path / "train_trl.jsonl").read_text().splitlines()]
    assert len(mrl_rows) == 3 * vs_trl.PROMPTS  # steps + one batch
    assert [(r["prompt"], r["reward_model"]["ground_truth"]) for r in mrl_rows] == \
        [(r["prompt"], r["ground_truth"]) for r in trl_rows] == vs_trl.problems(3, "digitsum")[: 3 * vs_trl.PROMPTS]
    assert {r["data_source"] for r in mrl_rows} == {"arith"}


def test_mrl_settings_equal_trls(tmp_path) -> None:
    """What mrl resolves from the quickstart file plus the script's overrides is what ``trl_worker`` passes to
    ``GRPOConfig``: a schedule or optimizer value the quickstart file sets (it decays the lr) must not leak in."""
    args = vs_trl.mrl_overrides(tmp_path, tmp_path / "model", "tiny", seed=5, steps=400, port=32000, extra=[])
    cfg = load_config(REPO / "mrl_configs" / "quickstart.yaml", args, check=False)
    o = cfg.actor.optim
    assert (o.lr, o.lr_schedule, o.lr_warmup_steps, o.lr_warmup_steps_ratio) == (vs_trl.LR, "constant", 0, 0.0)
    assert (o.weight_decay, o.clip_grad, tuple(o.betas), o.eps) == (0.0, 1.0, (0.9, 0.999), 1e-8)
    a = cfg.actor
    assert (a.clip_ratio_low, a.clip_ratio_high, a.entropy_coeff, a.use_kl_loss, a.loss_agg_mode) == \
        (0.2, 0.2, 0.0, False, "token-mean")
    assert a.ppo_mini_batch_size == cfg.data.train_batch_size == vs_trl.PROMPTS  # one optimizer step per step
    r = cfg.rollout
    assert (r.n, r.temperature, r.top_p, r.top_k, r.max_response_length) == (vs_trl.N, 1.0, 1.0, -1, 4)
    assert cfg.algorithm.norm_adv_by_std_in_grpo and not cfg.data.shuffle


def test_learning_table_interval() -> None:
    m, h = vs_trl.interval([1.0, 2.0, 3.0])
    assert m == 2.0 and math.isclose(h, 4.302652729749464 / math.sqrt(3), rel_tol=1e-9)  # t(0.975, 2) · s / √n
    steps = 100

    def run(seed: int, mrl: float, trl: float) -> dict:
        return {"curve": "digitsum tiny", "seed": seed, "mrl": {"reward": [mrl + 0.01 * seed] * steps},
                "trl": {"reward": [trl - 0.01 * seed] * steps}}

    rows = vs_trl.learning_table({f"s{i}": run(i, 0.2, 0.6) for i in range(4)}, at=(100, 200))
    assert len(rows) == 3 and rows[2].startswith("| digitsum tiny | 100 | 4 | 0.215 ± ") and rows[2].endswith("| TRL ahead |")
    rows = vs_trl.learning_table({f"s{i}": run(i, 0.5, 0.52) for i in range(4)})
    assert rows[2].endswith("| overlap |") and "| +0.010 ± " in rows[2]
