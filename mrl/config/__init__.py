"""Typed run configuration: one pydantic v2 section per component, YAML + dotted overrides.

Importing this package pulls in pydantic and PyYAML only (no torch, Ray, Megatron or SGLang), so
``mrl plan`` answers in well under 3 s.

    from mrl.config import load_config
    cfg = load_config("mrl_configs/quickstart.yaml", ["actor.optim.lr=1e-5"])
"""
from mrl.config.actor import ActorConfig
from mrl.config.agent import AgentConfig
from mrl.config.algorithm import (
    AlgorithmConfig,
    KLCtrlConfig,
    RefAlignmentConfig,
    RefRewardBlendConfig,
    ReprAlignConfig,
)
from mrl.config.cluster import ClusterConfig
from mrl.config.critic import CriticConfig, CriticOptimConfig
from mrl.config.data import DataConfig
from mrl.config.loader import ConfigError, apply_overrides, load_config, parse_override
from mrl.config.model import ModelConfig
from mrl.config.optim import OptimConfig
from mrl.config.parallel import ParallelConfig
from mrl.config.ref import RefConfig
from mrl.config.reward import RewardConfig
from mrl.config.rollout import RolloutConfig, ValKwargsConfig, WeightSyncConfig
from mrl.config.root import MRLConfig
from mrl.config.trainer import TrainerConfig
from mrl.config.validate import check_config

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "CriticConfig",
    "CriticOptimConfig",
    "DataConfig",
    "KLCtrlConfig",
    "MRLConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RefAlignmentConfig",
    "RefConfig",
    "RefRewardBlendConfig",
    "ReprAlignConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "ValKwargsConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "check_config",
    "load_config",
    "parse_override",
]
