"""Shared base for every config section: strict keys, documented fields.

Every section derives from :class:`Section` so that an unknown key is an error (``extra="forbid"``)
and assignments are re-validated (the driver fills ``total_training_steps`` after loading).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base class of all config sections (pydantic v2, unknown keys forbidden)."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        # `trainer.experiment_name=123` on the command line arrives as an int; keep it a string.
        coerce_numbers_to_str=True,
        use_attribute_docstrings=False,
    )
