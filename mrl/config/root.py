"""Root config: one typed section per component (names follow verl where a verl user looks)."""
from __future__ import annotations

from pydantic import Field

from mrl.config.actor import ActorConfig
from mrl.config.agent import AgentConfig
from mrl.config.algorithm import AlgorithmConfig
from mrl.config.base import Section
from mrl.config.cluster import ClusterConfig
from mrl.config.critic import CriticConfig
from mrl.config.data import DataConfig
from mrl.config.model import ModelConfig
from mrl.config.ref import RefConfig
from mrl.config.reward import RewardConfig
from mrl.config.reward_model import RewardModelConfig
from mrl.config.rollout import RolloutConfig
from mrl.config.side_model import RankSideModelConfig
from mrl.config.teacher import TeacherConfig
from mrl.config.trainer import TrainerConfig


class MRLConfig(Section):
    """A whole run: every section with its defaults; load with :func:`mrl.config.load_config`."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Ray cluster and devices.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="HF checkpoint all roles start from.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy model, optimizer and PPO loss.")
    ref: RefConfig = Field(default_factory=RefConfig, description="Frozen reference policy.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (PPO with GAE).")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation engines and sampling.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages, KL control, reward shaping.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="Model-based reward (phase rm_score).")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="Frozen teacher of on-policy distillation.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt datasets and batch size.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Run length, checkpoints, logging.")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="Multi-turn, tool-calling rollouts (docs/agent.md).")

    def rank_side_models(self) -> dict[str, RankSideModelConfig]:
        """The side models that run on Megatron ranks, by role (= their section's key), in layout order
        (mrl/config/side_model.py); each enabled one is a role of the layout."""
        return {"reward_model": self.reward_model, "teacher": self.teacher}

    @property
    def critic_enabled(self) -> bool:
        """critic.enable when set, else whether the estimator is GAE (the only one that needs values)."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    @property
    def ref_enabled(self) -> bool:
        """A reference model is built when ref.enable, or when some term consumes ref_log_prob [B, T]
        or the reference weights (repr_align embeds with the initial policy, docs/driver.md, "Reward shaping")."""
        if self.ref.enable is not None:
            return self.ref.enable
        a = self.algorithm
        return self.actor.use_kl_loss or a.use_kl_in_reward or a.ref_reward_blend.enable or self.repr_align_enabled

    @property
    def repr_align_enabled(self) -> bool:
        """algorithm.repr_align.enable and its only term, ref_alignment.enable."""
        r = self.algorithm.repr_align
        return r.enable and r.ref_alignment.enable

    @property
    def samples_per_step(self) -> int:
        """SAMPLES per step = data.train_batch_size (prompts) * rollout.n."""
        return self.data.train_batch_size * self.rollout.n
