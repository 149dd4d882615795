"""A plugin file (tests/plugins/difficulty_plugin.py) supplies an advantage estimator, a policy
loss and a prompt sampler without editing mrl: resolved from its path like a built-in name, checked against the built-ins
it reuses, and used from YAML in a 1-step end-to-end run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mrl.algorithms import get_adv_estimator, get_policy_loss_fn
from mrl.plugins import accepted_keywords
from tests.helpers.e2e import ROOT, free_port_pair, metrics, run_train, write_assets

PLUGIN = Path(__file__).resolve().parent / "difficulty_plugin.py"


def test_estimator_from_a_file_groups_by_difficulty() -> None:
    est = get_adv_estimator(f"{PLUGIN}:grpo_difficulty")
    assert get_adv_estimator("grpo_difficulty") is est  # registered by its decorator on import
    g = torch.Generator().manual_seed(0)
    r = torch.rand(6, 5, generator=g)
    m = (torch.rand(6, 5, generator=g) > 0.3).float()
    uid = ["a", "a", "b", "b", "b", "c"]
    # difficulty == prompt: exactly GRPO
    adv, ret = est(r, m, index=uid, extra_info=[{"difficulty": u} for u in uid])
    ref, _ = get_adv_estimator("grpo")(r, m, index=uid)
    torch.testing.assert_close(adv, ref, rtol=0, atol=1e-6)
    assert ret is adv
    # one difficulty level for all: one group (mean and unbiased std over the 6 sequence scores)
    adv, _ = est(r, m, index=uid, extra_info=[{"difficulty": "easy"}] * 6)
    s = r.sum(-1)
    torch.testing.assert_close(adv, ((s - s.mean()) / (s.std() + 1e-6)).unsqueeze(-1) * m, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="extra_info\\['difficulty'\\]"):
        est(r, m, index=uid, extra_info=[{}] * 6)
    # the driver offers the non-tensor fields; this estimator takes them through **unused
    assert accepted_keywords(est, ["extra_info", "data_source"]) == {"extra_info", "data_source"}
    assert accepted_keywords(get_adv_estimator("grpo"), ["extra_info", "data_source"]) == set()


def test_sampler_class_from_a_file_is_resumable() -> None:
    from types import SimpleNamespace

    from mrl.data.sampler import get_sampler_cls

    cls = get_sampler_cls(f"{PLUGIN}:easy_first")
    ds = SimpleNamespace(prompts=[SimpleNamespace(extra_info={"difficulty": "easy" if i % 3 else "hard"})
                                  for i in range(12)])
    s = cls(12, 4, shuffle=True, seed=3, dataset=ds)
    first = s.next_batch() + s.next_batch()
    assert all(i % 3 for i in first)  # the 8 easy prompts come first
    t = cls(12, 4, shuffle=True, seed=3, dataset=ds)
    t.load_state_dict(s.state_dict())
    assert t.next_batch() == s.next_batch()
    with pytest.raises(ValueError, match="did you mean 'resumable'"):
        get_sampler_cls("resumabel")
    with pytest.raises(ValueError, match="lacks next_batch, state_dict, load_state_dict, batches_per_epoch"):
        get_sampler_cls(f"{PLUGIN}:too_few_arguments")


def test_policy_loss_registered_name_from_a_file() -> None:
    loss = get_policy_loss_fn(f"{PLUGIN}:clipped_adv")  # the decorator's name, not the function's
    g = torch.Generator().manual_seed(1)
    old, new = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    adv, m = 3 * torch.randn(4, 7, generator=g), torch.ones(4, 7)
    kw = {"loss_agg_mode": "token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    out = loss(old, new, adv, m, **kw)
    ref = get_policy_loss_fn("vanilla")(old, new, adv.clamp(-1, 1), m, **kw)
    assert torch.equal(out.pg_loss, ref.pg_loss)
    assert not torch.equal(out.pg_loss, get_policy_loss_fn("vanilla")(old, new, adv, m, **kw).pg_loss)


@pytest.mark.slow
def test_plugins_from_yaml_train_one_step(tmp_path: Path) -> None:
    assets = write_assets(tmp_path)
    data = tmp_path / "train.jsonl"
    rows = [json.loads(x) for x in (assets / "data" / "train.jsonl").read_text().splitlines()]
    for row in rows:  # the per-prompt input the estimator needs: carries over = harder
        a, b = (int(t) for t in row["prompt"].split("is ")[1].split(" ?")[0].split(" + "))
        row["extra_info"]["difficulty"] = "hard" if a % 10 + b % 10 >= 10 else "easy"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    plugin = tmp_path / "plugin" / PLUGIN.name  # this test's copy: it logs its calls next to itself
    plugin.parent.mkdir()
    shutil.copyfile(PLUGIN, plugin)
    log = plugin.parent / "plugin_calls.jsonl"
    log.touch()
    cfg = yaml.safe_load((ROOT / "mrl_configs" / "quickstart.yaml").read_text())
    cfg["algorithm"] = {**cfg.get("algorithm", {}), "adv_estimator": f"{plugin}:grpo_difficulty"}
    cfg["actor"]["policy_loss"] = f"{plugin}:clipped_adv"
    cfg["data"] = {**cfg.get("data", {}), "sampler": {"class_path": f"{plugin}:easy_first"}}
    config = tmp_path / "plugins.yaml"
    config.write_text(yaml.safe_dump(cfg))
    p = run_train(str(config), tmp_path, assets, free_port_pair(), f"data.train_files=[{data}]",
                  f"data.val_files=[{assets}/data/val.jsonl]", "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
                  "trainer.save_freq=-1", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                  "actor.ppo_micro_batch_size_per_gpu=4")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    est = [c for c in calls if c["fn"] == "grpo_difficulty"]
    assert len(est) == 1 and est[0]["samples"] == 32 and est[0]["groups"] in (1, 2)
    # the loss ran inside the Ray rank actors (other processes than the driver's estimator)
    assert {c["pid"] for c in calls if c["fn"] == "clipped_adv"} - {est[0]["pid"]}
    assert sorted(metrics(tmp_path / "mlflow.db", "actor/pg_loss")) == [1]
    # the curriculum sampler drew the step's 8 prompts from the easy ones
    assert [(c["hard"], c["size"]) for c in calls if c["fn"] == "easy_first"] == [(0, 8)]
