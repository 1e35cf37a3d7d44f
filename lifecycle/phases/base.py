"""What every phase handler sees (:class:`RunContext`) and implements (:class:`PhaseHandler`).

Phase handlers are registered by phase name; the built-ins live next to this file. A step handler
(``train.kind``) implements :class:`StepHandler` and is found in :mod:`lifecycle.phases.registry`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lifecycle.dist.faults import Drills
    from lifecycle.obs.events import EventLog
    from lifecycle.policy.schema import Policy


@dataclass
class StopState:
    """Why and when the run should stop early."""

    preempt_signal: str | None = None
    """Signal name once a preemption signal arrived on this rank."""
    stop_step: int | None = None
    """The step all ranks agreed to stop at (after saving)."""
    shutdown: bool = False
    """The launcher is taking the job down (a SIGTERM that is not a preemption)."""


@dataclass
class RunContext:
    """Per-rank state shared by the phases of one run."""

    policy: Policy
    run_dir: Path
    rank: int
    world_size: int
    local_rank: int
    events: EventLog
    drills: Drills
    store: Any = None
    groups: list[Any] = field(default_factory=list)
    step_handler: Any = None
    step: int = 0
    """The last completed train step (0 before training; resume sets it)."""
    stop: StopState = field(default_factory=StopState)
    pending_save: Any = None
    """An async checkpoint not yet committed."""
    saved: list[str] = field(default_factory=list)
    """Committed checkpoint paths of this run."""
    resumed_from: int | None = None
    op_counts: Counter[str] = field(default_factory=Counter)
    """Collectives issued per group label (for the sequence check)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    phase_hooks: list[Any] = field(default_factory=list)
    """Callables ``hook(ctx, old_phase, new_phase, failure)`` run at every transition (all ranks, same order)."""
    watchdog: Any = None
    ckpt_group: Any = None
    """The dedicated gloo group of ``checkpoint.coordination: gloo`` (created at the first save)."""
    keys_taken: int = 0
    """Store keys taken so far: ranks take them in plan order, so a rank with fewer is behind (the watchdog
    publishes it)."""

    def next_key(self, name: str) -> str:
        """A store key unique per call and identical on every rank (calls happen in plan order)."""
        self.keys_taken += 1
        return f"lifecycle/{name}/{self.keys_taken - 1}"

    def deadline(self, phase: str) -> float:
        return self.policy.deadline(phase)


@runtime_checkable
class PhaseHandler(Protocol):
    """One phase. ``run`` issues collectives in the same order on every rank."""

    phase: str

    def run(self, ctx: RunContext) -> None: ...


class StepHandler(Protocol):
    """A ``train.kind``: builds its model in ``setup`` and runs one step per ``step`` call."""

    def setup(self, ctx: RunContext) -> None: ...

    def step(self, ctx: RunContext, step: int) -> dict[str, float]: ...

    def begin_save(self, ctx: RunContext, ckpt_dir: Path) -> Any: ...

    def load(self, ctx: RunContext, ckpt_dir: Path) -> int: ...

    def close(self) -> None: ...
