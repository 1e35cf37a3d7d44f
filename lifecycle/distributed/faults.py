"""Fault drills from the policy's ``faults`` list: rehearse a failure before the big job.

The orchestrator calls :meth:`Drills.fire` at every phase entry, before every op it issues and at
every train step. A matching drill acts on this rank only: ``stall`` sleeps forever, ``crash`` leaves
through ``os._exit`` (no teardown, like a segfault; the worker passes ``exit_codes.rank_failed`` as the code), ``raise`` raises :class:`DrillError`, ``signal``
sends SIGTERM to this process, ``skip`` makes the caller skip the op (a collective-sequence mismatch).
Each drill fires once and is logged loudly.

``zero_tokens`` acts inside the model instead, for many steps: from ``step`` on (or at each of ``steps``)
the routers of the drill rank's expert-parallel group send no token to its local experts. Every member of
that group has to mask them, so the step handler reads the policy's drills itself (:func:`starved_ranks`,
the same answer on every rank); :meth:`Drills.fire` only logs it on the drill's ranks at its first step.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lifecycle.errors import DrillError

if TYPE_CHECKING:
    from lifecycle.policy.schema import FaultDrill

log = logging.getLogger(__name__)
CRASH_EXIT_CODE = 17


class Drills:
    """The policy's drills for one rank."""

    def __init__(self, faults: list[FaultDrill], rank: int, *, on_fire: Callable[[FaultDrill], None] | None = None,
                 crash_code: int = CRASH_EXIT_CODE, attempt: int = 1) -> None:
        self.rank = rank
        self.attempt = attempt
        """This rank's attempt (agreed at init): a drill with ``attempts`` fires only in those."""
        self.crash_code = crash_code
        self.pending = [f for f in faults if rank in f.ranks]
        # slow drills in train act at every step from their step on: kept apart from the fire-once drills (a slow
        # drill at checkpoint fires once, before its op: a slow file system or a late writer)
        self.slow = [f for f in self.pending if f.action == "slow" and f.at == "train"]
        self.pending = [f for f in self.pending if f not in self.slow]
        self._slow_started: set[int] = set()
        self.held: list[bytes] = []
        self.poisoned: str | None = None
        """A ``nan_weights`` or ``perturb_weights`` drill fired (its action): the train loop writes it into the model
        before the step (then clears it)."""
        """What hold_memory drills hold, for the life of the process."""
        self.on_fire = on_fire
        armed = [f for f in [*self.pending, *self.slow] if in_attempt(f, attempt)]
        if armed:
            log.warning("FAULT DRILLS ARMED on rank %d: %s", rank,
                        "; ".join(f"{f.action} at {f.at}" + (f" step {f.step}" if f.step is not None else "")
                                  for f in armed))

    def _match(self, f: FaultDrill, phase: str, step: int | None, op: str | None, group: str | None) -> bool:
        if f.at != phase or not in_attempt(f, self.attempt):
            return False
        if f.steps and f.steps[0] != step:
            return False
        if f.step is not None and f.step != step:
            return False
        if f.op is not None and f.op != op:
            return False
        return f.group is None or f.group == group

    def slow_s(self, step: int) -> float:
        """Extra seconds of compute this rank adds to train ``step`` (``slow`` drills, from their step on)."""
        total = 0.0
        for i, f in enumerate(self.slow):
            if f.seconds is not None and step >= (f.step or 1) and in_attempt(f, self.attempt):
                if i not in self._slow_started:
                    self._slow_started.add(i)
                    log.warning("FAULT DRILL: slow (+%gs per step) on rank %d from step %d", f.seconds, self.rank,
                                step)
                    if self.on_fire is not None:
                        self.on_fire(f)
                total += f.seconds
        return total

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
        if f.action == "slow":
            time.sleep(f.seconds or 0.0)
            return False
        if f.action in ("nan_weights", "perturb_weights"):
            self.poisoned = f.action  # the train loop writes it into the model (it holds the step handler)
            return False
        if f.action == "hold_memory":
            self.held.append(b"\x01" * int((f.mib or 0.0) * 2**20))  # written, so resident until the process ends
            return False
        return f.action == "skip"


def in_attempt(f: FaultDrill, attempt: int) -> bool:
    """Whether drill ``f`` acts in ``attempt`` (``attempts``; null: every attempt)."""
    return f.attempts is None or attempt in f.attempts


def zero_token_drills(faults: Sequence[FaultDrill], attempt: int = 1) -> list[FaultDrill]:
    """The policy's ``zero_tokens`` drills of ``attempt`` (all ranks', not only this rank's)."""
    return [f for f in faults if f.action == "zero_tokens" and in_attempt(f, attempt)]


def starved_ranks(faults: Sequence[FaultDrill], step: int, attempt: int = 1) -> list[int]:
    """Global ranks whose local experts get no token at train ``step``: the same on every rank. Local."""
    out: set[int] = set()
    for f in zero_token_drills(faults, attempt):
        if (step in f.steps) if f.steps else (f.step is not None and step >= f.step):
            out.update(f.ranks)
    return sorted(out)
