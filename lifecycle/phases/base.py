"""What every phase handler implements (:class:`PhaseHandler`); the state they share is
:class:`lifecycle.context.RunContext`. Step handlers (``train.kind``) are in :mod:`lifecycle.handlers`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lifecycle.context import RunContext


class PhaseHandler(Protocol):
    """One phase of :data:`lifecycle.machine.graph.MAIN_PATH`. ``run`` issues its collectives in the same order
    on every rank (it is collective on the default group unless the phase says otherwise)."""

    phase: str

    def enabled(self, ctx: RunContext) -> bool:
        """Whether the policy runs this phase at all (the same answer on every rank)."""
        ...

    def run(self, ctx: RunContext) -> None: ...
