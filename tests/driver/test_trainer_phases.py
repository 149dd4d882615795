"""RLTrainer.step's phase logic without Ray: PPO order (values after ref, critic update before the
actor's), critic_warmup gating, GAE returns in the batch and the critic metrics, checkpoint layout.

The workers are a recorder that answers each rank method with plausible tensors; the estimator,
KL, metric and timer code is the real one.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mrl.algorithms import get_adv_estimator
from mrl.config import load_config
from mrl.config.run_plan import plan_run
from mrl.data.sampler import ResumableSampler
from mrl.driver.rm_reward import RewardModelInputs
from mrl.driver.scoring import Samples
from mrl.driver.trainer import RLTrainer, StepData
from tests.workers.batches import ragged_batch


class RecordingWorkers:
    """``execute_all(method, *args, **kwargs)`` -> ``[result]`` (rank 0's), with every call recorded
    (keyword arguments of the last call per method in ``kwargs``)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.kwargs: dict[str, dict] = {}
        self.values = values

    def execute_all(self, method: str, *args, **kwargs):
        self.calls.append((method, args))
        self.kwargs[method] = kwargs
        b = args[-1] if method == "compute_side" else args[0] if args else None  # compute_side(role, batch)
        out = {
            "compute_log_prob": lambda: (b.old_log_probs, torch.ones(b.response_mask.shape)),
            "compute_ref_log_prob": lambda: b.old_log_probs - 0.1 * b.response_mask,
            "compute_values": lambda: self.values,
            "compute_side": lambda: b.old_log_probs - 0.3 * b.response_mask,  # the teacher's log-probs
            "update_critic": lambda: {"critic/vf_loss": 0.25, "critic/vf_clipfrac": 0.0, "critic/vpred_mean": 0.1},
            "update_policy": lambda: {"actor/pg_loss": 0.5},
            # the on-policy shortcut: the update's own (here: made-up) log-probs and entropies come back
            "update_policy_on_policy": lambda: ({"actor/pg_loss": 0.5}, -0.5 * b.response_mask.float(),
                                                torch.full(b.response_mask.shape, 2.0)),
            # RunPlan.push_with_update: the same, plus this rank's sync report
            "update_policy_on_policy_and_sync": lambda: ({"actor/pg_loss": 0.5}, -0.5 * b.response_mask.float(),
                                                         torch.full(b.response_mask.shape, 2.0),
                                                         {"weight_sync/bytes": 10.0, "timing_s/weight_sync": 0.25}),
            "fallbacks": list,
        }.get(method, lambda: None)()
        return [out]

    def names(self) -> list[str]:
        """The phases' calls (not ``fallbacks``, the console's one query per run)."""
        return [f"{c[0]}:{c[1][0]}" if c[0] == "compute_side" else c[0] for c in self.calls if c[0] != "fallbacks"]


class RecordingPool:
    """The engine pool's memory calls, recorded into the workers' call list (one ordered log)."""

    def __init__(self, calls: list) -> None:
        self.calls, self.asleep, self.weight_version = calls, False, None
        self.engines = [SimpleNamespace(awaiting_sync=False, recovering=False) for _ in range(2)]

    def wait_recovered(self, timeout_s: float) -> None:
        self.waited = timeout_s

    def take_out_dead(self) -> list:  # every engine answers (tests/driver/test_rollout_controller_faults.py: one does not)
        return []

    def lost_engines(self) -> list:
        return []

    def readmit(self, version: str) -> list[str]:
        self.calls.append(("readmit", (version,)))
        for e in self.engines:
            e.awaiting_sync = False
        return []

    def release_memory(self) -> None:
        self.calls.append(("release_memory", ()))
        self.asleep = True

    def resume_memory(self, tags=None) -> None:
        self.calls.append(("resume_memory", tuple(tags or ())))
        if tags is None or "kv_cache" in tags:
            self.asleep = False


def _scores(batch) -> torch.Tensor:
    """1 on the last response token of every third sample (the reward phase's layout)."""
    scores = torch.zeros(batch.response_mask.shape)
    last = batch.response_mask.sum(-1) - 1
    scores[torch.arange(batch.batch_size), last] = (torch.arange(batch.batch_size) % 3 == 0).float()
    return scores


def _trainer(tmp_path, *overrides: str, rm_workers=None, ref_workers=None
             ) -> tuple[RLTrainer, RecordingWorkers, torch.Tensor]:
    """The quickstart's trainer on recording ranks; with the old-log-prob phase (actor.on_policy_shortcut=false)
    unless ``overrides`` say otherwise (test_on_policy_shortcut_* below)."""
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "t.jsonl").write_text("")
    cfg = load_config("mrl_configs/quickstart.yaml", [
        f"model.path={tmp_path}/m", f"data.train_files=[{tmp_path}/t.jsonl]", f"trainer.default_local_dir={tmp_path}/ck",
        "actor.on_policy_shortcut=false", *overrides])
    batch = ragged_batch().replace(advantages=None)
    values = torch.linspace(-0.5, 0.5, batch.response_length).expand(batch.batch_size, -1) * batch.response_mask
    workers = RecordingWorkers(values)
    plan = plan_run(cfg, "cpu", batches_per_epoch=64 // cfg.data.train_batch_size)
    services = SimpleNamespace(train_ds=list(range(64)), sampler=ResumableSampler(64, plan.gen_batch_size), workers=workers, rm_workers=rm_workers, teacher_workers=None, ref_workers=ref_workers, pool=RecordingPool(workers.calls),
                               client=None, log_dir=tmp_path, plan=plan, tracking=None, judge=None, stop=None,  # no metric sinks
                               rm_inputs=RewardModelInputs(None))  # (Services.tracking may be None); an RM reads the batch as it is
    tr = RLTrainer(cfg, services)
    scores = _scores(batch)

    def generate() -> StepData:  # the engine round trip is tested in the e2e tests
        tr.wake_engines()  # as the real phase does first
        tr.engine_weight_version = tr.weight_version
        return StepData(batch, [], [], torch.zeros_like(scores))

    def reward(d: StepData, m: dict) -> None:
        d.token_level_scores = scores

    tr.generate, tr.reward = generate, reward
    return tr, workers, values


PPO = ("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4", "algorithm.lam=0.95")


def test_ppo_phase_order_warmup_and_critic_metrics(tmp_path) -> None:
    tr, w, values = _trainer(tmp_path, *PPO, "trainer.critic_warmup=1")
    m1 = tr.step()
    # step 1 is critic-only: no actor update, no weight push (the engines keep version 0)
    assert w.names() == ["compute_log_prob", "compute_ref_log_prob", "compute_values", "update_critic"]
    assert "actor/pg_loss" not in m1 and "timing_s/update_actor" not in m1 and "timing_s/sync_weights" not in m1
    assert tr.weight_version == 0 and m1["rollout/weight_version"] == 0.0
    w.calls.clear()
    m2 = tr.step()
    assert w.names() == ["compute_log_prob", "compute_ref_log_prob", "compute_values", "update_critic",
                         "update_policy", "sync_weights"]
    assert w.kwargs["sync_weights"] == {"pause": False}  # synchronous step: nothing generates during the push
    assert m2["actor/pg_loss"] == 0.5 and tr.weight_version == 2
    # both updates saw the critic's values and GAE's returns = A_raw + V, not the advantages
    critic_batch = w.calls[3][1][0]
    actor_batch = w.calls[4][1][0]
    assert actor_batch is critic_batch and torch.equal(critic_batch.values, values)
    adv, ret = get_adv_estimator("gae")(_scores(critic_batch), critic_batch.response_mask.float(), values=values,
                                        gamma=1.0, lam=0.95)
    torch.testing.assert_close(critic_batch.returns, ret, rtol=0, atol=0)
    torch.testing.assert_close(critic_batch.advantages, adv, rtol=0, atol=0)
    assert not torch.allclose(critic_batch.returns, critic_batch.advantages)
    for m in (m1, m2):
        for k in ("timing_s/values", "timing_s/update_critic", "critic/vf_loss", "critic/vf_clipfrac",
                  "critic/vpred_mean", "critic/vf_explained_var", "critic/values/mean", "critic/values/max",
                  "critic/values/min", "critic/returns/mean", "critic/returns/max", "critic/returns/min"):
            assert k in m and math.isfinite(m[k]), k
    valid = critic_batch.response_mask.bool()
    assert m2["critic/returns/max"] == ret[valid].max().item()
    assert m2["critic/values/min"] == values[valid].min().item()


def test_distillation_phase_and_reward(tmp_path) -> None:
    """teacher_log_prob after old_log_prob; reverse_kl_reward adds -coef*(log pi_old - log pi_teacher) per token to the
    (weighed) task reward before the advantages; kl_loss passes the teacher's log-probs to the update instead."""
    (tmp_path / "teacher").mkdir()
    on = ("teacher.enable=true", f"teacher.path={tmp_path}/teacher", "actor.use_kl_loss=false")
    tr, w, _ = _trainer(tmp_path, *on, "algorithm.distill.mode=reverse_kl_reward", "algorithm.distill.coef=2.0",
                        "algorithm.distill.task_reward_coef=0.5", "algorithm.adv_estimator=reinforce_plus_plus")
    m = tr.step()
    assert w.names() == ["compute_log_prob", "compute_side:teacher", "update_policy", "sync_weights"]
    b = w.calls[2][1][0]  # what the update trained on
    mask = b.response_mask.float()
    rewards = 0.5 * _scores(b) - 2.0 * (0.3 * mask)  # log pi_old - log pi_teacher = 0.3 on every response token
    adv, _ = get_adv_estimator("reinforce_plus_plus")(rewards, mask, gamma=1.0)
    torch.testing.assert_close(b.advantages, adv, rtol=0, atol=1e-6)
    assert m["distill/reverse_kl"] == pytest.approx(0.3) and "timing_s/teacher" in m
    tr, w, _ = _trainer(tmp_path, *on, "algorithm.distill.mode=kl_loss")
    tr.step()
    b = w.calls[2][1][0]
    torch.testing.assert_close(b.teacher_log_prob, b.old_log_probs - 0.3 * b.response_mask)
    adv, _ = get_adv_estimator("grpo")(_scores(b), b.response_mask.float(), index=b.uid)
    torch.testing.assert_close(b.advantages, adv, rtol=0, atol=1e-6)  # the task reward alone: the KL is in the loss


def test_warmup_counts_steps_from_resume(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path, *PPO, "trainer.critic_warmup=3")
    tr.global_step = 2  # resumed after 2 critic-only steps: one more before the actor starts
    tr.step()
    assert "update_policy" not in w.names()
    tr.step()
    assert w.names()[-2:] == ["update_policy", "sync_weights"]


def test_grpo_has_no_critic_phases(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path)
    m = tr.step()
    assert w.names() == ["compute_log_prob", "compute_ref_log_prob", "update_policy", "sync_weights"]
    assert not any(k.startswith(("critic/values", "critic/vf")) or k == "timing_s/values" for k in m)
    # GRPO's returns are its advantages (as verl)
    assert m["critic/returns/mean"] == m["critic/advantages/mean"]


def test_save_and_resume_include_the_critic(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path, *PPO)
    tr.step()
    w.calls.clear()
    tr.save()
    ck = tmp_path / "ck" / "global_step_1"
    assert [(n, a) for n, a in w.calls if n.startswith("save")] == [
        ("save", (str(ck / "actor"), ["model", "optimizer", "extra"])), ("save_critic", (str(ck / "critic"),))]
    (ck / "critic").mkdir()  # the recorder writes nothing; the real save is in the e2e test
    tr2, w2, _ = _trainer(tmp_path, *PPO)
    tr2.maybe_resume()
    assert ("load_critic", (str(ck / "critic"),)) in w2.calls and tr2.global_step == 1
    assert ("load", (str(ck / "actor"), ["model", "optimizer", "extra"])) in w2.calls


def test_checkpoint_contents_reach_the_ranks(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path, "actor.checkpoint.save_contents=[model,extra,hf_model]")
    tr.step()
    tr.save()
    ck = tmp_path / "ck" / "global_step_1"
    assert ("save", (str(ck / "actor"), ["model", "extra", "hf_model"])) in w.calls
    tr2, w2, _ = _trainer(tmp_path, "actor.checkpoint.save_contents=[model,extra,hf_model]")
    tr2.maybe_resume()  # load_contents null = save_contents (verl's ${.save_contents})
    assert ("load", (str(ck / "actor"), ["model", "extra", "hf_model"])) in w2.calls


def test_remax_scores_one_greedy_answer_per_prompt_as_the_baseline(tmp_path) -> None:
    n = 2
    tr, w, _ = _trainer(tmp_path, "algorithm.adv_estimator=remax", f"rollout.n={n}", "actor.ppo_micro_batch_size_per_gpu=16")
    B = 8
    prompts = [SimpleNamespace(prompt_ids=[5, i], images=(), ground_truth=str(i), data_source="toy", extra_info={})
               for i in range(B // n)]
    requests = []

    def generate(req):
        requests.append(req)
        return SimpleNamespace(failed=[], samples=[SimpleNamespace(response_ids=[7]) for _ in req.prompts],
                               weight_versions={str(tr.weight_version)})

    def score(texts, truths, **kw):
        return SimpleNamespace(scores=torch.tensor([float(t) for t in truths]))  # baseline of prompt i = i

    tr.rollout.client = SimpleNamespace(generate=generate)  # ReMax generates through the RolloutController
    tr.s.reward, tr.s.tokenizer = score, SimpleNamespace(decode=lambda ids, skip_special_tokens: "x")
    gen = tr.generate

    def generate_with_prompts() -> StepData:
        d = gen()
        d.prompts = [p for p in prompts for _ in range(n)]
        return d

    tr.generate = generate_with_prompts
    m = tr.step()
    assert len(requests) == 1 and requests[0].n == 1 and requests[0].sampling_params["temperature"] == 0.0
    assert requests[0].prompts == [p.prompt_ids for p in prompts]
    baselines = torch.arange(B // n).float().repeat_interleave(n)
    batch = w.calls[-2][1][0]  # update_policy's batch
    adv, _ = get_adv_estimator("remax")(_scores(batch), batch.response_mask.float(), reward_baselines=baselines)
    torch.testing.assert_close(batch.advantages, adv, rtol=0, atol=0)
    assert "timing_s/gen_max" in m and m["critic/reward_baseline/mean"] == baselines.mean().item()


def test_free_cache_engine_sleeps_engines_while_training_and_pushes_weights_on_wake(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path, *PPO, "trainer.critic_warmup=1", "rollout.free_cache_engine=true")
    tr.step()  # critic-only: engines released after generation, not woken (nothing to push)
    assert w.calls[:2] == [("release_memory", ()), ("compute_log_prob", w.calls[1][1])]
    assert tr.s.pool.asleep and "sync_weights" not in w.names()
    w.calls.clear()
    tr.wake_engines()  # validation after a warmup step: the released weights are gone, push version 0 again
    assert w.calls == [("resume_memory", ("weights",)), ("sync_weights", (0,)), ("resume_memory", ("kv_cache",))]
    assert w.kwargs["sync_weights"] == {"pause": True}  # outside a step the engines are paused around the load
    w.calls.clear()
    tr.step()
    assert w.names()[0] == "release_memory" and w.calls[-3:] == [
        ("resume_memory", ("weights",)), ("sync_weights", (2,)), ("resume_memory", ("kv_cache",))]
    assert not tr.s.pool.asleep and tr.s.pool.weight_version == "2"


def test_free_cache_engine_defaults_off_on_cpu(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path)
    tr.step()
    assert "release_memory" not in w.names() and not tr.plan.free_cache_engine


def test_a_restarted_engine_rejoins_at_the_next_sync(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path)
    tr.s.pool.engines[1].awaiting_sync = True  # restarted by the pool, no snapshot to re-sync from
    tr.step()
    assert w.names()[-3:] == ["rejoin_weight_sync", "sync_weights", "readmit"]  # recoveries in flight waited for first
    assert w.calls[-1] == ("readmit", ("1",)) and not tr.s.pool.engines[1].awaiting_sync
    assert tr.s.pool.waited == tr.cfg.rollout.engine_startup_timeout_s


def _decode(ids, skip_special_tokens):
    assert skip_special_tokens  # verl's dumps decode with skip_special_tokens=True
    return " ".join(map(str, ids))


def test_rollout_dump_writes_the_steps_samples_after_scoring(tmp_path) -> None:
    import json

    tr, _, _ = _trainer(tmp_path, f"trainer.rollout_data_dir={tmp_path}/roll")
    gen, B = tr.generate, 8
    tr.s.tokenizer = SimpleNamespace(decode=_decode)

    def generate() -> StepData:
        d = gen()
        d.prompts = [SimpleNamespace(prompt_ids=[5, i // 2], images=(), ground_truth=str(i // 2)) for i in range(B)]
        d.texts = [f"answer {i}" for i in range(B)]
        return d

    def reward(d: StepData, m: dict) -> None:
        d.token_level_scores = _scores(d.batch)
        d.reward_extra_info = {"acc": [float(i % 3 == 0) for i in range(B)], "pred": [str(i) for i in range(B)]}

    tr.generate, tr.reward = generate, reward
    m = tr.step()
    tr.step()
    lines = (tmp_path / "roll" / "1.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"input": f"5 {i // 2}", "output": f"answer {i}", "gts": str(i // 2), "score": float(i % 3 == 0), "step": 1,
         "acc": float(i % 3 == 0), "pred": str(i)} for i in range(B)]
    assert (tmp_path / "roll" / "2.jsonl").is_file() and "timing_s/dump_rollout_generations" in m


def _with_validation(tr, logged: list) -> None:
    """A val set of 3 prompts answered by a fake engine and scored by a dict-returning fake scorer."""
    from mrl.rewards.manager import RewardResult

    prompts = [SimpleNamespace(prompt_ids=[9, i], images=(), ground_truth=str(i), data_source="toy", extra_info={})
               for i in range(3)]

    def generate(req):  # the engines hold the last pushed version (RolloutController.generate checks it)
        return SimpleNamespace(failed=[], samples=[SimpleNamespace(response_ids=[p[1]]) for p in req.prompts],
                               weight_versions={str(tr.weight_version)})

    def score(texts, truths, **kw):
        acc = [float(t == g and t != "2") for t, g in zip(texts, truths, strict=True)]
        return RewardResult(torch.tensor(acc), torch.ones(len(acc), dtype=torch.bool), None, [None] * len(acc),
                            {"score": acc, "acc": acc})

    tr.s.val_ds, tr.s.reward = prompts, score
    tr.rollout.client = SimpleNamespace(generate=generate)  # validation generates through the RolloutController
    tr.s.tokenizer = SimpleNamespace(decode=_decode)
    tr.s.tracking = SimpleNamespace(log=lambda metrics, step: logged.append((step, metrics)),
                                    log_artifact=lambda path: logged.append(("artifact", path)))


def test_val_only_validates_the_start_weights_once_and_trains_nothing(tmp_path) -> None:
    import json

    tr, w, _ = _trainer(tmp_path, "trainer.val_only=true", "trainer.val_before_train=true",
                        f"trainer.validation_data_dir={tmp_path}/val", "trainer.total_training_steps=3")
    logged: list = []
    _with_validation(tr, logged)
    tr.fit()
    assert w.names() == [] and tr.global_step == 0  # no generation, update or sync
    assert [step for step, _ in logged] == [0]
    assert logged[0][1]["val-core/toy/acc/mean@1"] == pytest.approx(2 / 3)
    rows = [json.loads(x) for x in (tmp_path / "val" / "0.jsonl").read_text().splitlines()]
    assert rows == [{"input": f"9 {i}", "output": str(i), "gts": str(i), "score": float(i != 2), "step": 0,
                     "reward": float(i != 2), "acc": float(i != 2)} for i in range(3)]


def test_val_only_after_resume_validates_the_resumed_weights(tmp_path) -> None:
    tr, _, _ = _trainer(tmp_path)
    tr.step()
    tr.save()
    tr2, w2, _ = _trainer(tmp_path, "trainer.val_only=true", "trainer.val_before_train=true")
    logged: list = []
    _with_validation(tr2, logged)
    tr2.fit()
    # the resumed actor is loaded and pushed to the engines (version 1), validated at step 1, not trained
    assert w2.names() == ["load", "sync_weights"] and w2.calls[1][1] == (1,)
    assert [step for step, _ in logged] == [1] and tr2.global_step == 1


def test_val_before_train_validates_even_without_test_freq(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path, "trainer.val_before_train=true", "trainer.test_freq=0", "trainer.total_training_steps=1")
    logged: list = []
    _with_validation(tr, logged)
    tr.fit()
    assert [step for step, m in logged if step != "artifact" and any(k.startswith("val-core/") for k in m)] == [0]
    assert tr.global_step == 1 and "update_policy" in w.names()
    png = tmp_path / "ck" / "learning_curve.png"  # the run directory: trainer.default_local_dir
    assert logged[-1] == ("artifact", png) and png.read_bytes()[:4] == b"\x89PNG"


def test_free_cache_engine_defaults_on_for_colocated_cuda_engines(tmp_path) -> None:
    """The run plan decides once, from the resolved device (cluster.device=auto is resolved by Ray)."""
    cfg = _trainer(tmp_path)[0].cfg
    assert plan_run(cfg, "cuda").free_cache_engine and not plan_run(cfg, "cpu").free_cache_engine
    assert cfg.cluster.device == load_config("mrl_configs/quickstart.yaml").cluster.device  # nothing written back


def test_on_policy_shortcut_takes_log_pi_old_from_the_update(tmp_path) -> None:
    """No compute_log_prob call: the update's log-probs become old_log_probs (for the metrics after the
    update) and its entropies entropy_old; the engine-vs-trainer check is computed from them."""
    tr, w, _ = _trainer(tmp_path, "actor.on_policy_shortcut=null", "rollout.weight_sync.transport=tensor")
    assert tr.plan.on_policy_shortcut
    rollout_lp = -0.5 * ragged_batch().response_mask.float()
    base_generate = tr.generate

    def generate() -> StepData:  # an engine that returns its log-probs
        d = base_generate()
        d.batch = d.batch.replace(rollout_log_probs=rollout_lp)
        return d

    tr.generate = generate
    m = tr.step()
    assert w.names() == ["compute_ref_log_prob", "update_policy_on_policy", "sync_weights"]
    sent = w.calls[1][1][0]
    assert sent.old_log_probs is not None  # ragged_batch's; the ranks' shortcut ignores it (test_on_policy_shortcut.py)
    assert "timing_s/old_log_prob" not in m and m["actor/pg_loss"] == 0.5
    assert m["actor/entropy_old"] == 2.0
    assert m["training/rollout_probs_diff_max"] == 0.0  # the update's log-probs = the engine's here


def test_inprocess_engines_take_the_new_weights_in_the_update_call(tmp_path) -> None:
    """transport=inprocess with the shortcut: one rank call updates and loads the engines (no sync_weights
    call); the step still records the push: version, the ranks' sync metrics, the pool's version."""
    tr, w, _ = _trainer(tmp_path, "actor.on_policy_shortcut=null", "rollout.weight_sync.transport=inprocess")
    assert tr.plan.push_with_update
    m = tr.step()
    assert w.names() == ["compute_ref_log_prob", "update_policy_on_policy_and_sync"]
    assert w.calls[1][1][1] == 1  # the version the engines now hold
    assert tr.weight_version == 1 and tr.s.pool.weight_version == "1"
    assert m["weight_sync/bytes"] == 10.0 and m["timing_s/weight_sync"] == 0.25 and "timing_s/sync_weights" in m
    assert m["actor/entropy_old"] == 2.0
    w.calls.clear()
    tr.step()
    assert w.calls[1] == ("update_policy_on_policy_and_sync", (w.calls[1][1][0], 2))


def test_on_policy_shortcut_keeps_the_old_log_prob_phase_while_the_critic_warms_up(tmp_path) -> None:
    tr, w, _ = _trainer(tmp_path, *PPO, "trainer.critic_warmup=1", "actor.on_policy_shortcut=null",
                        "rollout.weight_sync.transport=tensor")
    tr.step()
    assert w.names() == ["compute_log_prob", "compute_ref_log_prob", "compute_values", "update_critic"]
    w.calls.clear()
    tr.step()
    assert w.names() == ["compute_ref_log_prob", "compute_values", "update_critic", "update_policy_on_policy",
                         "sync_weights"]


def test_a_separate_reference_answers_ref_log_prob_on_its_own_group(tmp_path) -> None:
    """ref.placement=separate: phase ref_log_prob calls the reference's group (compute_side("ref", batch)), never
    the trainer ranks, and the update trains on that group's answer."""
    ref_group = RecordingWorkers(torch.zeros(()))  # its compute_side answers old_log_probs - 0.3 on the mask
    tr, w, _ = _trainer(tmp_path, "cluster.n_gpus_per_node=3", "ref.placement=separate", "ref.num_devices=1",
                        ref_workers=ref_group)
    tr.step()
    assert w.names() == ["compute_log_prob", "update_policy", "sync_weights"]  # no compute_ref_log_prob
    assert ref_group.names() == ["compute_side:ref"]
    sent = ref_group.calls[0][1][1]
    update = next(args[0] for name, args in w.calls if name == "update_policy")
    torch.testing.assert_close(update.ref_log_prob, sent.old_log_probs - 0.3 * sent.response_mask)


def test_a_separate_reward_model_scores_on_its_own_group(tmp_path) -> None:
    """reward_model.placement=separate: phase rm_score (and validation's RM) calls the RM's group, never the
    trainer ranks; the metrics and the reward (combine=rm) are the colocated path's."""
    from tests.workers.batches import ragged_batch

    batch = ragged_batch()
    rm_scores = torch.linspace(-1.0, 2.0, batch.batch_size)

    class RMGroup:
        def __init__(self) -> None:
            self.calls = []

        def execute_all(self, method, *args):
            self.calls.append((method, args))
            return [rm_scores.clone(), rm_scores.clone()]  # every rank answers the same

    group = RMGroup()
    tr, w, _ = _trainer(tmp_path, "cluster.n_gpus_per_node=3", "reward_model.enable=true",
                        f"reward_model.model.path={tmp_path}/rm", "reward_model.placement=separate",
                        "reward_model.num_devices=1", rm_workers=group)
    prompts = [SimpleNamespace(ground_truth="1", data_source="toy", extra_info={}) for _ in range(batch.batch_size)]
    d = StepData(batch, prompts, ["x"] * batch.batch_size, torch.zeros(batch.response_mask.shape))
    m: dict[str, float] = {}
    RLTrainer.reward(tr, d, m)  # the real phase (_trainer stubs it for the other tests)
    assert [c[0] for c in group.calls] == ["compute_side"] and group.calls[0][1][0] == "reward_model"
    assert group.calls[0][1][1] is batch and "compute_side:reward_model" not in w.names()
    assert m["critic/rm_score/mean"] == pytest.approx(float(rm_scores.mean()))
    assert (m["critic/rm_score/min"], m["critic/rm_score/max"]) == (-1.0, 2.0) and "timing_s/rm_score" in m
    # combine=rm: the RM score is the reward, on one (the last response) token
    torch.testing.assert_close(d.token_level_scores.sum(-1), rm_scores)
    assert bool(((d.token_level_scores != 0).sum(-1) <= 1).all())
    val, own = tr.scorer.validate(Samples(prompts, d.texts, lambda: batch), rule=lambda extra: pytest.fail("combine=rm"))
    torch.testing.assert_close(val.scores, rm_scores)  # validation: the same call, the same reward
    torch.testing.assert_close(own["rm_score"], rm_scores)
    assert len(group.calls) == 2
