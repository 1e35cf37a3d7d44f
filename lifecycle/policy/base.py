"""Shared pydantic base for every policy section: strict, frozen, documented."""

from __future__ import annotations

import types
from typing import Annotated, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationInfo, field_validator

Phase = Literal["init", "warmup", "train", "checkpoint", "teardown"]
PHASES: tuple[str, ...] = get_args(Phase)
"""The phases in their main-path order."""


DEADLINE_KEYS: tuple[str, ...] = ("init", "warmup", "step", "checkpoint", "teardown", "setup", "eval")
"""The ``watchdog.deadlines`` keys: the one name of each deadline, in the YAML, the engine, events and reports."""


def check_deadline_key(key: str) -> str:
    """``key`` when it is a ``watchdog.deadlines`` key, else a ValueError naming the keys (``train`` is a phase)."""
    if key not in DEADLINE_KEYS:
        raise ValueError(f"{key!r} is not a watchdog.deadlines key (one of {', '.join(DEADLINE_KEYS)})")
    return key


"""The phase names, declared once (``lifecycle.machine.graph`` reads them from here: the policy layer
imports nothing from the machine)."""


MAX_STEP = (1 << 62) - 1
"""The largest train step: steps travel between the ranks as int64 (a checkpoint naming a larger one is forged)."""
Steps = Annotated[int, Field(ge=0, le=MAX_STEP)]
"""A step count or step number (0 to :data:`MAX_STEP`)."""
PositiveSteps = Annotated[int, Field(ge=1, le=MAX_STEP)]

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

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_integers(cls, value: object, info: ValidationInfo) -> object:
        """``tp: true`` is a typo, not 1: an integer key takes integers only (pydantic would take a boolean)."""
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _takes_int(field.annotation):
                raise ValueError("Input should be an integer, not a boolean")
        return value


def _takes_int(annotation: object) -> bool:
    """An ``int`` field (or ``int | None``), not one that also takes booleans."""
    if get_origin(annotation) is Annotated:
        return _takes_int(get_args(annotation)[0])
    if annotation is int:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return len(args) == 1 and _takes_int(args[0])
    return False
