"""The config's accepted algorithm names and the ``mrl.algorithms`` registries must agree.

``mrl.config`` may not import torch, so it keeps its own ``Literal`` lists; these tests read the
accepted values from the pydantic field annotations and compare them, both ways, with
``LOSS_AGG_MODES``, ``KL_PENALTY_NAMES``, ``policy_loss_names()`` and ``adv_estimator_names()``.
``full`` is accepted by the schema and refused by validation (tests/config/test_validation.py) and
by ``kl_penalty``; it is the one allowed difference.
"""
from __future__ import annotations

import typing

import pytest
import torch
from pydantic import BaseModel, ValidationError

import mrl.algorithms as alg
from mrl.config.actor import ActorConfig
from mrl.config.algorithm import AlgorithmConfig
from mrl.config.critic import CriticConfig

REFUSED_BY_BOTH = {"full"}


def _accepted(model: type[BaseModel], field: str) -> set[str] | None:
    """String values a ``Literal`` field accepts (None for a free ``str`` field)."""
    ann = model.model_fields[field].annotation
    args = typing.get_args(ann) if typing.get_origin(ann) is typing.Literal else None
    return None if args is None else {a for a in args if isinstance(a, str)}


def test_loss_agg_modes_agree() -> None:
    for model in (ActorConfig, CriticConfig):
        assert _accepted(model, "loss_agg_mode") == set(alg.LOSS_AGG_MODES), model.__name__


def test_full_is_refused_by_the_algorithms() -> None:
    assert REFUSED_BY_BOTH.isdisjoint(alg.KL_PENALTY_NAMES)
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_loss_type"):
        alg.kl_penalty(x, x, "full")


def test_config_kl_names_exist_in_algorithms() -> None:
    for model, field in ((ActorConfig, "kl_loss_type"), (AlgorithmConfig, "kl_penalty")):
        missing = _accepted(model, field) - REFUSED_BY_BOTH - set(alg.KL_PENALTY_NAMES)
        assert not missing, f"{model.__name__}.{field} accepts {sorted(missing)} that kl_penalty refuses"


def test_algorithm_kl_names_are_accepted_by_config() -> None:
    for model, field in ((ActorConfig, "kl_loss_type"), (AlgorithmConfig, "kl_penalty")):
        missing = set(alg.KL_PENALTY_NAMES) - _accepted(model, field)
        assert not missing, f"{model.__name__}.{field} refuses {sorted(missing)}"


def test_algorithm_adv_estimators_are_accepted_by_config() -> None:
    missing = set(alg.adv_estimator_names()) - _accepted(AlgorithmConfig, "adv_estimator")
    assert not missing, f"algorithm.adv_estimator refuses registered estimators {sorted(missing)}"


def test_config_adv_estimators_exist_in_algorithms() -> None:
    extra = _accepted(AlgorithmConfig, "adv_estimator") - set(alg.adv_estimator_names())
    assert not extra, f"algorithm.adv_estimator accepts unregistered {sorted(extra)}"


def test_registered_policy_losses_are_accepted_by_config() -> None:
    accepted = _accepted(ActorConfig, "policy_loss")
    for name in alg.policy_loss_names():
        assert accepted is None or name in accepted
        assert ActorConfig(policy_loss=name).policy_loss == name


def test_config_refuses_unknown_policy_loss() -> None:
    accepted = _accepted(ActorConfig, "policy_loss")
    assert accepted is not None and accepted <= set(alg.policy_loss_names())
    with pytest.raises(ValidationError, match="policy_loss"):
        ActorConfig(policy_loss="clip_cov")
