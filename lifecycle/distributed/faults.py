"""Fault drills from the policy's ``faults`` list: rehearse a failure before the big job.

The orchestrator calls :meth:`Drills.fire` at every phase entry, before every op it issues and at
every train step. A matching drill acts on this rank only: ``stall`` sleeps forever, ``crash`` leaves
through ``os._exit`` (no teardown, like a segfault; the worker passes ``exit_codes.rank_failed`` as the code), ``raise`` raises :class:`DrillError`, ``signal``
sends SIGTERM to this process, ``skip`` makes the caller skip the op (a collective-sequence mismatch).
Each drill fires once and is logged loudly.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lifecycle.errors import PhaseError

if TYPE_CHECKING:
    from lifecycle.policy.schema import FaultDrill

log = logging.getLogger(__name__)
CRASH_EXIT_CODE = 17


class DrillError(PhaseError):
    """Raised by a ``raise`` drill."""


class Drills:
    """The policy's drills for one rank."""

    def __init__(self, faults: list[FaultDrill], rank: int, *, on_fire: Callable[[FaultDrill], None] | None = None,
                 crash_code: int = CRASH_EXIT_CODE) -> None:
        self.rank = rank
        self.crash_code = crash_code
        self.pending = [f for f in faults if rank in f.ranks]
        self.on_fire = on_fire
        if self.pending:
            log.warning("FAULT DRILLS ARMED on rank %d: %s", rank,
                        "; ".join(f"{f.action} at {f.at}" + (f" step {f.step}" if f.step is not None else "")
                                  for f in self.pending))

    def _match(self, f: FaultDrill, phase: str, step: int | None, op: str | None, group: str | None) -> bool:
        if f.at != phase:
            return False
        if f.step is not None and f.step != step:
            return False
        if f.op is not None and f.op != op:
            return False
        return f.group is None or f.group == group

    def fire(self, phase: str, *, step: int | None = None, op: str | None = None,
             group: str | None = None) -> bool:
        """Fire the first matching drill. Returns True when the caller must skip the op."""
        for f in self.pending:
            if self._match(f, phase, step, op, group):
                self.pending.remove(f)
                return self._act(f, phase, step, op, group)
        return False

    def _act(self, f: FaultDrill, phase: str, step: int | None, op: str | None, group: str | None) -> bool:
        where = f"phase {phase}" + (f" step {step}" if step is not None else "") + \
                (f" op {op}" if op else "") + (f" group {group}" if group else "")
        log.warning("FAULT DRILL: %s on rank %d at %s", f.action, self.rank, where)
        if self.on_fire is not None:
            self.on_fire(f)
        if f.action == "stall":
            while True:
                time.sleep(3600)
        if f.action == "crash":
            os._exit(self.crash_code)
        if f.action == "raise":
            raise DrillError(f"fault drill: raise on rank {self.rank} at {where}", phase=phase, rank=self.rank,
                             group=group)
        if f.action == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
            return False
        return f.action == "skip"
