"""Shared pydantic base for every policy section: strict, frozen, documented."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Phase = Literal["init", "warmup", "train", "checkpoint", "teardown"]
"""The phase names, declared once (``lifecycle.machine.graph`` reads them from here: the policy layer
imports nothing from the machine)."""


class Section(BaseModel):
    """A policy section: unknown keys are errors, values are immutable once validated."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
        populate_by_name=True,
    )
