"""Shared base for every config section: strict keys, documented fields.

Every section derives from :class:`Section` so that an unknown key is an error (``extra="forbid"``)
and assignments are re-validated (the driver fills ``total_training_steps`` after loading).
"""
from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    """Base class of all config sections (pydantic v2, unknown keys forbidden)."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        # `trainer.experiment_name=123` on the command line arrives as an int; keep it a string.
        coerce_numbers_to_str=True,
        use_attribute_docstrings=False,
        # `lr: .inf` or `temperature: .nan` is never meant; refuse instead of training on it.
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode turns `lr: true` into 1.0 and `ppo_epochs: true` into 1: a typo
        # (or a misplaced key) would silently become a hyper-parameter.
        if isinstance(v, bool) and info.field_name and _numeric_only(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"got the boolean {v}, expected a number; fix: give a number (true/false are not 1/0)")
        return v


def _numeric_only(annotation: Any) -> bool:
    """True when ``annotation`` admits int/float (possibly with None) but not bool."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    return bool(args) and bool not in args and any(a in (int, float) for a in args)
