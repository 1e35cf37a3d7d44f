"""What every phase handler implements (:class:`PhaseHandler`) and the actions it states it will issue
(:class:`Action`, its ``plan``); the state they share is :class:`lifecycle.context.RunContext`. Step handlers
(``train.kind``) are in :mod:`lifecycle.handlers`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

from lifecycle.jsontypes import JsonDict

if TYPE_CHECKING:
    from lifecycle.context import RunContext
    from lifecycle.policy.schema import Policy


@dataclass(frozen=True)
class Action:
    """One thing a phase does: an op on a group with a deadline, recorded as the span ``event`` (None: no span of
    its own). ``when`` says on which condition it runs (empty: always, in this order)."""

    op: str
    group: str | None = None
    deadline_s: float | None = None
    detail: str = ""
    names: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    event: str | None = ""
    when: str = ""
    nbytes: int = 0
    """The message size of a sized warmup op (``warmup.sizes: job``); 0 for the 1-element ops."""

    @property
    def span(self) -> str | None:
        """The span name a run records for this action (the op unless ``event`` says otherwise)."""
        return self.op if self.event == "" else self.event

    def as_dict(self) -> JsonDict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if v not in (None, "", ()) and k != "event"}


@dataclass(frozen=True)
class WarmTarget:
    """A distinct communicator to warm, with every symbolic name it answers to."""

    names: tuple[str, ...]
    ranks: tuple[int, ...] = ()


class GroupView(Protocol):
    """Which requested groups exist for this rank, de-duplicated by communicator, in a fixed order."""

    def warm_targets(self, requested: Sequence[str]) -> list[WarmTarget]: ...


class PhaseHandler(Protocol):
    """One phase of :data:`lifecycle.machine.graph.MAIN_PATH`. ``run`` issues its collectives in the same order
    on every rank (it is collective on the default group unless the phase says otherwise); ``plan`` states them
    beforehand, without torch (``lifecycle explain`` prints it; a test holds a real run's events against it)."""

    phase: str

    def enabled(self, ctx: RunContext) -> bool:
        """Whether the policy runs this phase at all (the same answer on every rank)."""
        ...

    def run(self, ctx: RunContext) -> None: ...

    @staticmethod
    def plan(policy: Policy, view: GroupView | None = None) -> list[Action]:
        """The actions ``run`` issues for ``policy``, in order (``view``: one rank's real groups)."""
        ...


def barrier_actions(policy: Policy, point: str, deadline: float) -> list[Action]:
    """The barriers of ``barriers.<point>``, in the policy's order."""
    points = getattr(policy.barriers, point)
    return [Action(f"barrier:{point}", b.group, b.timeout_s or deadline, f"via {b.via}, if missing {b.if_missing}")
            for b in points]


def sequence_check(policy: Policy, boundary: str) -> list[Action]:
    """The collective-sequence check the ranks run when they leave a phase (``watchdog.sequence_check``)."""
    if not policy.watchdog.sequence_check:
        return []
    return [Action("sequence_check", "world", None, f"per-group collective counts compared over the store, "
                   f"{boundary}", when=boundary)]


def deadline_text(policy: Policy, key: str) -> str:
    """``600s``, or for an auto deadline ``auto after 20 steps: 4 x p99 over 200, in [5s, 600s]`` (``key``: a
    ``watchdog.deadlines`` key)."""
    from lifecycle.watchdog.adaptive import floor_of

    static = policy.deadline(key)
    if not policy.is_auto(key):
        return f"{static:g}s"
    a = policy.watchdog.adaptive
    return (f"auto after {a.calibration_steps} {'steps' if key == 'step' else key + ' spans'}: "
            f"{a.factor:g} x p{a.quantile * 100:g} over the last {a.window}, in [{floor_of(a, key):g}s, {static:g}s], "
            f"max over ranks; {static:g}s until then")
