"""Shared pydantic base for every policy section: strict, frozen, documented."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

Phase = Literal["init", "warmup", "train", "checkpoint", "teardown"]
"""The phase names, declared once (``lifecycle.machine.graph`` reads them from here: the policy layer
imports nothing from the machine)."""


MAX_SECONDS = 1e9
"""The longest deadline or timeout (about 31 years): a larger one overflows the timers it sets."""

Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
"""A deadline or timeout: finite, > 0 and at most :data:`MAX_SECONDS` (``inf`` and ``nan`` are refused)."""

Flag = Annotated[bool, Strict()]
"""A boolean: true or false only (pydantic would otherwise take "yes", "on", 1 ...)."""


class Section(BaseModel):
    """A policy section: unknown keys are errors, values are immutable once validated."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
        populate_by_name=True,
    )
