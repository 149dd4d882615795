"""The config's accepted algorithm names and the ``mrl.algorithms`` registries must agree.

``mrl.config`` may not import torch, so it keeps its own ``Literal`` lists; these tests read the
accepted values from the pydantic field annotations and compare them, both ways, with
``LOSS_AGG_MODES`` and ``KL_PENALTY_NAMES``. Advantage estimators and policy losses have no such
copy: the config takes any name or plugin spec and ``mrl plan`` checks it against the registries.
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
from mrl.config.validate_extensions import builtin_names
from mrl.data.sampler import _SAMPLERS

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


@pytest.mark.parametrize("key, table", [("algorithm.adv_estimator", lambda: alg.advantages._ADV._table),
                                        ("actor.policy_loss", lambda: alg.policy_loss._POLICY_LOSSES._table),
                                        ("data.sampler.class_path", lambda: _SAMPLERS)])
def test_plan_reads_the_registries_own_names(key, table) -> None:
    # The registries are the one list of names: `mrl plan` reads their decorators without torch,
    # and that reading must equal what mrl's own modules registered (plugins loaded by other tests
    # in this process register from their own modules).
    own = sorted(n for n, fn in table().items() if fn.__module__.startswith("mrl."))
    assert builtin_names(key) == own and own


def test_config_fields_are_free_strings_checked_at_plan_time() -> None:
    for model, field in ((AlgorithmConfig, "adv_estimator"), (ActorConfig, "policy_loss")):
        assert _accepted(model, field) is None  # no Literal copy of the registry
    with pytest.raises(ValidationError, match="policy_loss"):
        ActorConfig(policy_loss="not a name!")
