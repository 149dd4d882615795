"""The RL loop (ARCHITECTURE.md, "One step"; verl's GRPO/PPO data flow): build once, then ``step()``
as named phases: generate -> reward (-> sample dump, trainer.rollout_data_dir) (-> greedy baseline for
ReMax) (-> engines release their memory, rollout.free_cache_engine) -> old_log_prob -> ref_log_prob
-> teacher_log_prob (distillation) -> values (PPO) -> KL in reward (-> distillation reward) -> reward shaping (docs/driver.md, "Reward shaping": ref_reward_blend, repr_align) -> advantages
-> update_critic (PPO) -> update_actor (after trainer.critic_warmup) -> sync_weights -> validate / checkpoint / log.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mrl.algorithms import (
    apply_kl_penalty,
    distill_metrics,
    get_adv_estimator,
    get_kl_controller,
    informative_groups,
    overlong_penalty,
    reverse_kl_reward,
)
from mrl.config import MRLConfig
from mrl.driver import base_model, disk_full
from mrl.driver.async_rollout import AsyncRollout, ProducedBatch
from mrl.driver.batch import (
    assemble_train_batch,
    decode_responses,
    mask_out_samples,
    repeat_prompts,
    tools_kwargs_of,
    with_agent_info,
)
from mrl.driver.dumps import GenerationRows, dump_generations
from mrl.driver.dynamic_sampling import kept_prompts, merge_rounds
from mrl.driver.finite import stop_if_not_finite
from mrl.driver.ranks import TrainRanks
from mrl.driver.rm_reward import RewardModelScorer
from mrl.driver.rollout_controller import RolloutController
from mrl.driver.rollout_correction import apply_rollout_correction
from mrl.driver.scoring import RuleScorer, Samples, SampleScorer
from mrl.driver.seeds import group_seeds
from mrl.driver.shaping import (
    build_gold_batch,
    check_gold_answers,
    encode_gold,
    ref_blend,
    repr_align,
)
from mrl.driver.side_ranks import SideModel, SideModelRanks, side_model
from mrl.driver.state import (
    find_resume_dir,
    prune_checkpoints,
    read_trainer_state,
    step_dir,
    write_trainer_state,
)
from mrl.driver.validation import run_validation
from mrl.driver.vision import request_inputs
from mrl.observability.data_metrics import (
    compute_data_metrics,
    compute_rollout_mismatch_metrics,
    compute_throughput_metrics,
)
from mrl.observability.fallbacks import summary_line
from mrl.observability.progress import Curves, Progress
from mrl.observability.timer import timer
from mrl.plugins import accepted_keywords
from mrl.rewards.manager import place_on_last_token
from mrl.rollout.partial import version_number
from mrl.rollout.types import RolloutRequest, RolloutResult
from mrl.workers.batch import TrainBatch

if TYPE_CHECKING:
    from mrl.driver.build import Services

log = logging.getLogger(__name__)


@dataclass
class StepData:
    """What one step carries between phases (typed, not a growing dict)."""

    batch: TrainBatch
    prompts: list[Any]              # B Prompt records (repeated n times, interleaved)
    texts: list[str]                # B decoded responses (for the scorer)
    token_level_scores: torch.Tensor  # [B, R]
    token_level_rewards: torch.Tensor | None = None  # [B, R]
    entropys: torch.Tensor | None = None  # [B, R]
    reward_baselines: torch.Tensor | None = None  # [B] ReMax: score of the prompt's greedy answer
    # verl's reward_extra_info (a dict-returning scorer's keys -> [B] values): kept with the batch as
    # verl keeps it in non_tensor_batch; verl logs no training metrics from it (only rollout dumps).
    reward_extra_info: dict[str, list[Any]] | None = None
    rows: list[int] = field(default_factory=list)  # P dataset rows of the prompts (their uids)
    result: RolloutResult | None = None  # the engines' answers (dynamic sampling re-assembles from them)
    scores: torch.Tensor | None = None  # [B] the scorer's scores (before the overlong penalty)
    valid: torch.Tensor | None = None  # [B] False where reward.on_error=mask dropped the sample
    pushed: list[dict[str, float]] | None = None  # per-rank sync reports when the update call synced too


def sample_scorer(cfg: MRLConfig, services: Services, rm: SideModel) -> SampleScorer:
    """The run's reward scorer (mrl/driver/scoring.py): reward.judge's, the reward model's (``rm``: its side model),
    or reward.function alone; check_config allows at most one model-judged reward."""
    if services.judge is not None:
        return services.judge
    if cfg.reward_model.enable:
        return RewardModelScorer(rm, services.rm_inputs, cfg.reward_model.combine)
    return RuleScorer()


class RLTrainer:
    """Holds the built components; ``fit()`` runs the loop. ``services`` is ``mrl.driver.build``'s result."""

    def __init__(self, cfg: MRLConfig, services: Services) -> None:
        self.cfg, self.s = cfg, services
        self.ranks = TrainRanks(services.workers)  # typed calls to every trainer rank
        # the side models' phases (rm_score, teacher_log_prob): answered by the trainer ranks or their own groups
        self.rm = side_model("reward_model", services.rm_workers, self.ranks)
        self.teacher = side_model("teacher", services.teacher_workers, self.ranks)
        # ref.placement=separate: the reference's own group answers ref_log_prob; colocated, the trainer ranks
        self.ref = SideModel("ref", SideModelRanks(services.ref_workers)) if services.ref_workers is not None else None
        self.scorer = sample_scorer(cfg, services, self.rm)  # phase reward, in training and validation
        self.rollout = RolloutController(services.pool, services.client, self.ranks,
                                         startup_timeout_s=cfg.rollout.engine_startup_timeout_s,
                                         log_dir=services.log_dir)
        a = cfg.algorithm
        self.kl_ctrl = get_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon)
        self.adv_fn = get_adv_estimator(a.adv_estimator)
        if cfg.repr_align_enabled:  # fail now, not at the first step
            check_gold_answers(services.train_ds.prompts, cfg.data.ground_truth_key)
        self.plan = services.plan
        self.sampler = services.sampler  # the training prompts' order (its state is checkpointed)
        self.global_step = 0
        self.weight_version = 0  # engines start from model.path = version 0 of the actor
        at = cfg.trainer.async_training  # off-policy: a rollout producer runs ahead (docs/async.md)
        self.producer = AsyncRollout(self.rollout, self.sampler, self.rollout_request, max_staleness=at.max_staleness,
                                     partial=cfg.rollout.partial_rollout, timeout_s=at.batch_timeout_s) if at.max_staleness else None
        self.produced: ProducedBatch | None = None

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        m: dict[str, float] = {}
        ph = self.plan.phases
        with timer("step", m):
            with timer("gen", m):
                d = self.generate()
            if ph.agent:  # turns, tool calls, tool errors/timeouts (docs/agent.md)
                from mrl.agent.loop import agent_metrics

                m |= agent_metrics(d.result)
            with timer("reward", m):
                self.reward(d, m)
            if ph.filter_groups:
                with timer("filter_groups", m):  # DAPO dynamic sampling: more rounds until the batch is full
                    d = self.filter_groups(d, m)
            if ph.dump_rollout:
                with timer("dump_rollout_generations", m):
                    self.dump_rollout(d)
            if ph.remax_baseline:
                with timer("gen_max", m):  # verl's name for the greedy baseline rollout
                    self.remax_baseline(d, m)
            if self.plan.free_cache_engine:
                with timer("engine_sleep", m):
                    self.rollout.sleep()
            # actor.on_policy_shortcut: update_actor's own forward gives log π_old (docs/driver.md)
            shortcut = self.plan.on_policy_shortcut and self.actor_update_due()
            if not shortcut:
                with timer("old_log_prob", m):
                    self.old_log_prob(d, m)
            if self.producer is not None:  # refuse samples older than max_staleness; staleness metrics
                self.producer.admit(d, self.weight_version, self.produced, m)
            if ph.ref:
                with timer("ref", m):
                    self.ref_log_prob(d)
            if ph.teacher:
                with timer("teacher", m):
                    self.teacher_log_prob(d)
            if ph.values:
                with timer("values", m):
                    self.values(d)
            self.kl_in_reward(d, m)
            if ph.distill_reward:
                self.distill_reward(d)
            if ph.shape_rewards:
                with timer("reward_shaping", m):
                    self.shape_rewards(d, m)
            with timer("adv", m):
                self.advantages(d)
            if ph.values:
                with timer("update_critic", m):
                    m |= self.ranks.update_critic(d.batch)
            if self.actor_update_due():
                with timer("update_actor", m):
                    if shortcut:
                        self.update_on_policy(d, m, push=self.plan.push_with_update)
                    else:
                        m |= self.ranks.update_policy(d.batch)
                stop_if_not_finite(m, self.global_step + 1, fp16=self.plan.dtype == "float16")
                with timer("sync_weights", m):
                    self.sync_weights(m, d.pushed)
        self.global_step += 1
        if self.producer is not None:
            self.producer.step_done(self.global_step)
        m |= compute_data_metrics(response_mask=d.batch.response_mask, token_level_scores=d.token_level_scores,
                                  token_level_rewards=d.token_level_rewards, advantages=d.batch.advantages,
                                  returns=d.batch.returns, values=d.batch.values,
                                  max_response_length=self.cfg.rollout.max_response_length)
        m |= compute_throughput_metrics(m, int(d.batch.attention_mask.sum()), self.cfg.cluster.world_size)
        if d.batch.teacher_log_prob is not None:
            m |= distill_metrics(d.batch.old_log_probs, d.batch.teacher_log_prob, d.batch.response_mask)
        m["actor/entropy_old"] = float((d.entropys * d.batch.response_mask).sum() / d.batch.response_mask.sum().clamp(min=1))
        m["rollout/weight_version"] = float(self.weight_version)  # pushed after this step's update
        m["rollout/engine_weight_version"] = float(self.engine_weight_version)  # what generated this step
        m["training/global_step"] = float(self.global_step)
        return m

    # ---- phases -------------------------------------------------------------------------------
    def generate(self) -> StepData:
        """P prompts -> P·n samples from the engine pool (uid = dataset row, shared by the group); off-policy
        (trainer.async_training.max_staleness > 0): the rollout producer's batch for this step."""
        if self.producer is not None:
            if not self.producer.started:  # after a resume: from the restored sampler and weights
                self.producer.start(self.global_step, self.weight_version, end=self.total_steps())
            b = self.produced = self.producer.take(self.global_step)
            pb, idx, res = b.prompts, b.rows, b.result
            self.engine_weight_version = min((version_number(v) for s in res.samples for v in s.token_versions()),
                                             default=b.start_version)  # the oldest token trained on
        else:
            self.wake_engines()
            idx = self.sampler.next_batch()
            pb, req = self.rollout_request(idx, self.global_step, self.sampler.epoch)
            # engine_weight_version: what the engines themselves reported for these samples
            res, self.engine_weight_version = self.rollout.generate(req, self.weight_version)
        batch = assemble_train_batch(pb, res, pad_token_id=self.s.pad_token_id, uids=idx,
                                     routed_experts=self.cfg.actor.moe.engine_routed_experts,
                                     multi_modal=self.s.pictures.model_inputs(pb.prompts) if self.s.pictures else None)
        # agent rollouts: each sample's prompt carries its turns and tool calls as extra_info["agent"]
        return StepData(batch, with_agent_info(repeat_prompts(pb.prompts, self.plan.samples_per_prompt), res),
                        decode_responses(self.s.tokenizer, res),
                        torch.zeros(batch.response_mask.shape), rows=list(idx), result=res)

    def rollout_request(self, idx: list[int], step: int, epoch: int) -> tuple[Any, RolloutRequest]:
        """The collated prompts of dataset rows ``idx`` and their request for step ``step``."""
        pb = self.s.train_ds.collate(idx)
        r, n = self.cfg.rollout, self.plan.samples_per_prompt
        ids, image_data = request_inputs(pb.prompts)  # pictures: the engine ids and SGLang's image_data
        return pb, RolloutRequest(ids, n=n, image_data=image_data, sampling_params={
            "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "max_new_tokens": r.max_response_length,
        }, timeout_s=r.request_timeout_s,  # per-sample seeds: reproducible and resume-exact draws (mrl/driver/seeds.py)
            sampling_seeds=group_seeds(self.cfg.trainer.seed, "train", step, epoch, idx, n),
            tools_kwargs=tools_kwargs_of(pb.prompts))

    def reward(self, d: StepData, m: dict[str, float]) -> None:
        """Scores on the last response token (verl's ray_trainer step; docs/driver.md): token_level_scores [B, R], plus
        DAPO's overlong penalty when reward.overlong_buffer.enable; samples whose scoring failed
        under reward.on_error=mask leave the loss and their group's baseline."""
        def rule(extra: list) -> Any:
            return self.s.reward(d.texts, [p.ground_truth for p in d.prompts], d.batch.response_mask,
                                 data_sources=[p.data_source for p in d.prompts], extra_infos=extra)

        # the run's scorer (reward.function alone, with the reward model, or with the judge: mrl/driver/scoring.py)
        out = self.scorer.train(Samples(d.prompts, d.texts, lambda: d.batch), rule, m)
        d.scores, d.valid, d.reward_extra_info = out.scores, out.valid, out.extra
        seq = d.scores
        ob = self.cfg.reward.overlong_buffer
        if ob.enable:
            seq = seq + overlong_penalty(d.batch.response_mask.sum(-1), self.cfg.rollout.max_response_length,
                                         ob.len, ob.penalty_factor)
        d.token_level_scores = place_on_last_token(seq, d.batch.response_mask)
        self.drop_invalid(d, m)

    def drop_invalid(self, d: StepData, m: dict[str, float]) -> None:
        """reward.on_error=mask: a failed sample's response mask becomes 0 (out of the loss) and it gets
        a group of its own (out of the GRPO/RLOO baseline of its prompt's other samples)."""
        if d.valid is None or bool(d.valid.all()):
            return
        bad = ~d.valid
        d.batch = mask_out_samples(d.batch, bad)
        d.token_level_scores = d.token_level_scores * d.valid[:, None]
        m["reward/masked_samples"] = float(bad.sum())
        log.warning("reward.on_error=mask: %d of %d samples left out of the loss (scoring failed)",
                    int(bad.sum()), bad.numel())

    def dump_rollout(self, d: StepData) -> None:
        """trainer.rollout_data_dir: the samples this step trains on as verl's JSONL (mrl/driver/dumps.py),
        in ``<step>.jsonl`` with the step number its metrics are logged at; score = the sample's
        token_level_scores sum (overlong penalty included, 0 for samples masked out)."""
        decode = self.s.tokenizer.decode
        rows = GenerationRows([decode(p.prompt_ids, skip_special_tokens=True) for p in d.prompts], list(d.texts),
                              [p.ground_truth for p in d.prompts], d.token_level_scores.sum(-1).tolist(),
                              dict(d.reward_extra_info or {}))
        dump_generations(self.cfg.trainer.rollout_data_dir, self.global_step + 1, rows)

    def filter_groups(self, d: StepData, m: dict[str, float]) -> StepData:
        """DAPO dynamic sampling (verl algorithm.filter_groups): keep the groups whose metric varies
        (``informative_groups``); generate and score further rounds of data.gen_batch_size prompts
        until data.train_batch_size are kept (at most max_num_gen_batches rounds; 0 = no limit), then
        train on the first train_batch_size of them. ``train/num_gen_batches``: the rounds used."""
        fg, n, want = self.cfg.algorithm.filter_groups, self.plan.samples_per_prompt, self.cfg.data.train_batch_size
        rounds = [(d, informative_groups(self.filter_metric(d), d.batch.uid))]
        while kept_prompts(rounds, n) < want:
            if 0 < fg.max_num_gen_batches <= len(rounds):
                raise RuntimeError(
                    f"dynamic sampling kept {kept_prompts(rounds, n)} of the {want} prompts data.train_batch_size needs "
                    f"after algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} rounds: too many groups "
                    "score the same for every sample (data too easy or too hard); fix: raise max_num_gen_batches "
                    "(0 = no limit) or data.gen_batch_size, or use easier/harder data")
            with timer("gen", m):
                nxt = self.generate()
            with timer("reward", m):
                self.reward(nxt, m)
            rounds.append((nxt, informative_groups(self.filter_metric(nxt), nxt.batch.uid)))
        m["train/num_gen_batches"] = float(len(rounds))
        merged = StepData(**merge_rounds(rounds, n=n, max_prompts=want, dataset=self.s.train_ds,
                                         pad_token_id=self.s.pad_token_id,
                                         routed_experts=self.cfg.actor.moe.engine_routed_experts))
        self.drop_invalid(merged, {})
        return merged

    def filter_metric(self, d: StepData) -> torch.Tensor:
        """[B] values whose spread within a group decides whether dynamic sampling keeps it."""
        metric = self.cfg.algorithm.filter_groups.metric
        if metric == "acc":
            if "acc" not in (d.reward_extra_info or {}):
                raise RuntimeError(
                    f"algorithm.filter_groups.metric=acc but reward.function={self.cfg.reward.function} returned no 'acc' "
                    "key; fix: return {'score': ..., 'acc': ...} from it (docs/rewards.md) or set "
                    "algorithm.filter_groups.metric=score")
            return torch.tensor(d.reward_extra_info["acc"], dtype=torch.float64)
        if metric == "score":
            return d.scores
        # seq_reward = seq_final_reward here: KL-in-reward comes later (config refuses it with seq_final_reward)
        return d.token_level_scores.sum(-1)

    def remax_baseline(self, d: StepData, m: dict[str, float]) -> None:
        """ReMax (Li et al. 2023): one greedy answer per prompt, scored like the samples; its score is
        the baseline ``b`` of the prompt's n samples (verl's ``reward_baselines``)."""
        n = self.plan.samples_per_prompt
        prompts = d.prompts[::n]  # d.prompts is each prompt n times in a row
        ids, image_data = request_inputs(prompts)
        res, _ = self.rollout.generate(RolloutRequest(ids, n=1, image_data=image_data, sampling_params={
            "temperature": 0.0, "max_new_tokens": self.cfg.rollout.max_response_length}, return_logprob=False,
            timeout_s=self.cfg.rollout.request_timeout_s, tools_kwargs=tools_kwargs_of(prompts)),
            self.weight_version, what="ReMax baseline")
        prompts = with_agent_info(prompts, res)  # agent rollouts: the greedy trajectory's record for the scorer
        out = self.s.reward(decode_responses(self.s.tokenizer, res), [p.ground_truth for p in prompts],
                            data_sources=[p.data_source for p in prompts], extra_infos=[p.extra_info for p in prompts])
        d.reward_baselines = out.scores.float().repeat_interleave(n)
        m["critic/reward_baseline/mean"] = float(d.reward_baselines.mean())

    def old_log_prob(self, d: StepData, m: dict[str, float]) -> None:
        """log π_old [B, R] and entropy [B, R] with the rollout temperature (recomputed, not the engine's),
        and verl's check that the engines sampled from that distribution (training/rollout_probs_diff_*)."""
        lp, ent = self.ranks.compute_log_prob(d.batch)
        d.batch = d.batch.replace(old_log_probs=lp)
        d.entropys = ent
        if d.batch.rollout_log_probs is not None:  # engines that return log-probs (all mrl launches)
            m |= compute_rollout_mismatch_metrics(d.batch.rollout_log_probs, lp, d.batch.response_mask)
        if self.cfg.algorithm.rollout_correction.enabled:  # verl's rollout_corr: IS weights + rejection mask
            d.batch, corr = apply_rollout_correction(d.batch, self.cfg.algorithm.rollout_correction)
            m |= corr

    def update_on_policy(self, d: StepData, m: dict[str, float], *, push: bool = False) -> None:
        """update_actor with the on-policy shortcut: log π_old and the entropies come from the update's own
        forward (π_old = π_θ before its only optimizer step), then the same checks as old_log_prob.
        ``push`` (RunPlan.push_with_update): the same call loads the new weights into the in-process engines
        as the next version; sync_weights then only records it."""
        if push:
            metrics, lp, ent, d.pushed = self.ranks.update_policy_on_policy_and_sync(d.batch, self.global_step + 1)
        else:
            metrics, lp, ent = self.ranks.update_policy_on_policy(d.batch)
        m |= metrics
        d.batch = d.batch.replace(old_log_probs=lp)
        d.entropys = ent
        if d.batch.rollout_log_probs is not None:
            m |= compute_rollout_mismatch_metrics(d.batch.rollout_log_probs, lp, d.batch.response_mask)

    def ref_log_prob(self, d: StepData) -> None:
        """log π_ref [B, R] of the sampled tokens, once per step: the separate reference's ranks, or the colocated
        one's weights swapped into the actor's chunks on the trainer ranks (mrl/workers/reference.py)."""
        lp = self.ref(d.batch) if self.ref is not None else self.ranks.compute_ref_log_prob(d.batch)
        d.batch = d.batch.replace(ref_log_prob=lp)

    def teacher_log_prob(self, d: StepData) -> None:
        """log π_teacher [B, R] of the sampled tokens (on-policy distillation, docs/distillation.md); distill/* are
        logged at the end of the step, against log π_old (which the on-policy shortcut computes in the update)."""
        d.batch = d.batch.replace(teacher_log_prob=self.teacher(d.batch))

    def distill_reward(self, d: StepData) -> None:
        """Distilling: the task's score weighed by task_reward_coef (a KL-in-reward penalty is left as it is), and with
        mode=reverse_kl_reward r_t −= coef·(log π_old − log π_teacher); after KL-in-reward, before shaping and the
        advantage estimator (mrl/algorithms/distill.py)."""
        dist = self.cfg.algorithm.distill
        if dist.task_reward_coef != 1.0:
            d.token_level_rewards = d.token_level_rewards - (1.0 - dist.task_reward_coef) * d.token_level_scores
        if dist.mode == "reverse_kl_reward":
            d.token_level_rewards = d.token_level_rewards + reverse_kl_reward(
                d.batch.old_log_probs, d.batch.teacher_log_prob, d.batch.response_mask, dist.coef)

    def values(self, d: StepData) -> None:
        """V_old(s_t) [B, R] from the critic (0 outside the response mask): GAE's baseline and the
        clipping centre of the value loss."""
        d.batch = d.batch.replace(values=self.ranks.compute_values(d.batch))

    def kl_in_reward(self, d: StepData, m: dict[str, float]) -> None:
        """r = score − β·KL(π_old‖π_ref) per token when algorithm.use_kl_in_reward, else r = score."""
        if self.cfg.algorithm.use_kl_in_reward:
            d.token_level_rewards, kl_m = apply_kl_penalty(
                d.token_level_scores, d.batch.old_log_probs, d.batch.ref_log_prob, d.batch.response_mask,
                self.kl_ctrl, self.cfg.algorithm.kl_penalty)
            m |= kl_m
        else:
            d.token_level_rewards = d.token_level_scores

    def shape_rewards(self, d: StepData, m: dict[str, float]) -> None:
        """After KL-in-reward: ref_reward_blend, then repr_align (mrl/driver/shaping.py; docs/driver.md, "Reward shaping")."""
        a, step, total = self.cfg.algorithm, self.global_step, self.total_steps()
        if a.ref_reward_blend.enable:
            d.token_level_rewards = ref_blend(a.ref_reward_blend, d.token_level_rewards, d.batch.ref_log_prob,
                                              d.batch.response_mask, step=step, total_steps=total, metrics=m)
        if self.cfg.repr_align_enabled:
            def similarity() -> torch.Tensor:
                gold = build_gold_batch(d.batch, encode_gold(
                    self.s.tokenizer, d.prompts, key=self.cfg.data.ground_truth_key,
                    max_length=self.cfg.rollout.max_response_length), pad_token_id=self.s.pad_token_id)
                return self.ranks.compute_repr_similarity(d.batch, gold)
            d.token_level_rewards = repr_align(a.repr_align.ref_alignment, d.token_level_rewards, d.batch.response_mask,
                                               d.entropys, step=step, total_steps=total, similarity=similarity, metrics=m)

    def advantages(self, d: StepData) -> None:
        a = self.cfg.algorithm
        # returns: GAE's value targets A + V (the critic regresses on them); the outcome estimators
        # return their advantages there, as verl (logged as critic/returns/* either way).
        # Non-tensor fields (verl's non_tensor_batch) go to an estimator that names them (plugins).
        offered = {"extra_info": lambda: [p.extra_info for p in d.prompts],
                   "data_source": lambda: [p.data_source for p in d.prompts],
                   "reward_extra_info": lambda: dict(d.reward_extra_info or {})}
        extra = {k: offered[k]() for k in accepted_keywords(self.adv_fn, offered)}
        adv, ret = self.adv_fn(d.token_level_rewards, d.batch.response_mask.float(), index=d.batch.uid,
                               values=d.batch.values, reward_baselines=d.reward_baselines, gamma=a.gamma, lam=a.lam,
                               norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo, **extra)
        d.batch = d.batch.replace(advantages=adv, returns=ret)

    def actor_update_due(self) -> bool:
        """False for the first ``trainer.critic_warmup`` steps (critic-only updates; the engines keep
        the start weights, so no sync either). verl's ``critic_warmup <= global_steps`` with its
        1-based step counter starts the actor one step earlier; we keep the documented count."""
        return self.global_step >= self.cfg.trainer.critic_warmup

    def sync_weights(self, m: dict[str, float], pushed: list[dict[str, float]] | None = None) -> None:
        """Push the updated actor into every engine as version ``global_step + 1`` (``pushed``: the update
        call already did, these are the ranks' reports)."""
        self.weight_version = self.global_step + 1
        if pushed is not None:
            self.rollout.pushed(self.weight_version, pushed, m)
        else:
            self.push_weights(m)

    def push_weights(self, m: dict[str, float]) -> None:
        """The actor's weights -> every engine as ``weight_version`` (RolloutController.push; with a running
        rollout producer, made safe against its generations: AsyncRollout.push)."""
        if self.producer is not None and self.producer.started:
            self.producer.push(self.weight_version, m)
        else:  # synchronous: this step's rollout has returned and the next starts after the push
            self.rollout.push(self.weight_version, m, pause=False)

    def wake_engines(self) -> None:
        """Wake engines released after the last generation when no update has synced them since
        (critic warmup, validation): released weights are not kept (SGLang's memory saver drops
        them), so the current version is pushed again. A no-op when the engines are awake."""
        self.rollout.wake(self.weight_version)

    # ---- validation, checkpoints, loop -------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """rollout.val_kwargs answers to every val prompt, verl's val-core/val-aux metrics
        (mrl/driver/validation.py); the MLflow sink writes '@' as '_at_' (MLflow refuses '@').
        trainer.validation_data_dir: every sample to ``<dir>/<global_step>.jsonl`` (0 = before training)."""
        if self.s.val_ds is None:
            return {}
        dump_dir = self.cfg.trainer.validation_data_dir
        res = run_validation(generate=lambda req: self.rollout.generate(req, self.weight_version, "validation")[0],
                             tokenizer=self.s.tokenizer, dataset=self.s.val_ds,
                             reward=self.s.reward, rollout=self.cfg.rollout, val_batch_size=self.cfg.data.val_batch_size,
                             log_generations=self.cfg.trainer.log_val_generations, keep_samples=bool(dump_dir),
                             seed=(self.cfg.trainer.seed, self.global_step), scorer=self.scorer)
        if res.generations and self.s.tracking is not None:
            self.s.tracking.log_generations(res.generations, self.global_step)
        if dump_dir:
            dump_generations(dump_dir, self.global_step, res.samples)
        return res.metrics

    @functools.cached_property
    def base_model(self) -> dict:
        """model.path's identity (mrl/driver/base_model.py), computed at the first save."""
        return base_model.record(self.cfg.model.path)

    def save(self) -> None:
        root = self.cfg.trainer.checkpoint_dir
        d = step_dir(root, self.global_step)
        # actor.checkpoint.save_contents; hf_model adds a transformers directory at actor/huggingface
        self.ranks.save(str(d / "actor"), list(self.cfg.actor.checkpoint.save_contents))
        if self.cfg.critic_enabled:
            self.ranks.save_critic(str(d / "critic"))
        sampler = self.producer.sampler_state() if self.producer is not None else self.sampler.state_dict()
        write_trainer_state(root, self.global_step, {"sampler": sampler,
                                                     "kl_ctrl": self.kl_ctrl.state_dict(),
                                                     "weight_version": self.weight_version,
                                                     "total_training_steps": self.total_steps(),
                                                     "mlflow_run_id": getattr(self.s.tracking, "mlflow_run_id", None),
                                                     "base_model": self.base_model})
        for gone in prune_checkpoints(root, self.cfg.trainer.max_ckpt_to_keep):
            log.info("max_ckpt_to_keep=%s: removed %s", self.cfg.trainer.max_ckpt_to_keep, gone)

    def maybe_resume(self) -> None:
        d = find_resume_dir(self.cfg.trainer.checkpoint_dir, self.cfg.trainer.resume_mode)
        if d is None:
            return
        st = read_trainer_state(d)
        self.ranks.load(str(d / "actor"), self.cfg.actor.checkpoint.load)
        if self.cfg.critic_enabled:
            if not (d / "critic").is_dir():
                raise FileNotFoundError(f"{d} has no critic/ checkpoint but the critic is enabled; fix: resume "
                                        "from a PPO checkpoint, or set trainer.resume_mode=disable to start fresh")
            self.ranks.load_critic(str(d / "critic"))
        self.sampler.load_state_dict(st["sampler"])
        self.kl_ctrl.load_state_dict(st["kl_ctrl"])
        self.global_step = int(st["global_step"])
        # The engines restarted from model.path: push the resumed weights as the saved version.
        self.weight_version = int(st.get("weight_version", self.global_step))
        self.rollout.resumed(self.weight_version)
        log.info("resumed from %s at step %d", d, self.global_step)
        saved_total = st.get("total_training_steps")
        if saved_total is not None and saved_total != self.total_steps():
            log.warning("the checkpoint was written by a run of %d steps, this one has %d "
                        "(trainer.total_training_steps): the LR schedule is rebuilt for %d steps from step %d",
                        saved_total, self.total_steps(), self.total_steps(), self.global_step)

    def plot_curves(self, curves: Curves) -> None:
        """score / val / entropy against the step -> <run dir>/learning_curve.png, and into the MLflow run."""
        path = curves.plot(self.plan.log_dir.parent / "learning_curve.png",  # log_dir = <checkpoint dir>/logs
                           title=f"{self.cfg.trainer.project_name}/{self.cfg.trainer.experiment_name}")
        if path is not None:
            log.info("learning curve: %s (verl's metric lines: %s)", path, path.parent / "metrics.log")
            if self.s.tracking is not None:
                self.s.tracking.log_artifact(path)

    def total_steps(self) -> int:
        assert self.plan.total_steps is not None  # build's plan knows the training rows
        return self.plan.total_steps

    def fit(self) -> None:
        t = self.cfg.trainer
        self.maybe_resume()
        total = self.total_steps()
        # verl: val_before_train validates whatever test_freq says; val_only then stops (nothing trained)
        fallbacks = summary_line(self.ranks.fallbacks() + self.rm.fallbacks() + self.teacher.fallbacks()
                                 + (self.ref.fallbacks() if self.ref is not None else []))
        if fallbacks:
            log.info("%s", fallbacks)
        progress, curves = Progress(total, start_step=self.global_step), Curves()
        if t.val_only or t.val_before_train:
            val = self.validate()
            self.s.tracking.log(val, self.global_step)
            curves.add(self.global_step, val)
            progress.update(self.global_step, val)
            if t.val_only:
                log.info("trainer.val_only: validated at step %d, not training", self.global_step)
                return
        while self.global_step < total:
            if self.s.stop is not None:  # named in the line a SIGTERM / Ctrl-C stops the run with
                self.s.stop.step = self.global_step + 1
            m = self.step()
            last = self.global_step == total
            if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                with timer("testing", m):
                    self.wake_engines()  # asleep after a step without an actor update (critic warmup)
                    m |= self.validate()
            saved = t.save_freq > 0 and t.checkpoint_dir and (self.global_step % t.save_freq == 0 or last)
            if saved:
                with timer("save_checkpoint", m), disk_full.checkpoint_save(t.checkpoint_dir, self.global_step):
                    self.save()
            self.s.tracking.log(m, self.global_step)
            if saved:  # a resume from this checkpoint finds every step up to it in the MLflow run
                self.s.tracking.flush()
            curves.add(self.global_step, m)
            progress.update(self.global_step, m)
        self.plot_curves(curves)
        if self.producer is not None:
            self.producer.stop()

