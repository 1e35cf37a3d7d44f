"""What the watchdog reads of a rank's run: :class:`WatchedRun` (its thread) and :class:`CheckedRun` (the
collective-sequence check, a phase hook on the training thread).

:class:`lifecycle.context.RunContext` is both; the watchdog names only these protocols, so mypy holds it to them:
a new read of the run from the watchdog thread must be added here first, where the rule is stated — it reads only
what is frozen (the identity), guarded (the deadline book, the op counter's snapshot, the compute window), or
replaced whole (the warmed groups, a tuple; the step and the restarts left, ints).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import Store

    from lifecycle.distributed.groups import ResolvedGroup
    from lifecycle.distributed.parallel import ParallelState
    from lifecycle.jsontypes import JsonDict
    from lifecycle.obs.events import EventLog
    from lifecycle.policy.schema import Policy
    from lifecycle.watchdog.adaptive import Derivation
    from lifecycle.watchdog.tracker import ProgressTracker


class Deadlines(Protocol):
    """The deadline book (each learned deadline under its own lock)."""

    def deadline(self, key: str) -> float: ...

    def derivation(self, key: str) -> Derivation | None: ...


class Ops(Protocol):
    def snapshot(self) -> tuple[dict[str, int], int]:
        """The collectives issued per group label and the store keys taken, read together under one lock."""
        ...


class Compute(Protocol):
    def fields(self) -> JsonDict:
        """The recent step compute times' median (under the window's lock)."""
        ...


class Comms(Protocol):
    @property
    def groups(self) -> tuple[ResolvedGroup, ...]:
        """Replaced whole by warmup, never edited in place."""
        ...

    @property
    def restart_round(self) -> int: ...

    @property
    def store(self) -> Store | None: ...


class Progress(Protocol):
    @property
    def restarts_left(self) -> int: ...


class WatchedRun(Protocol):
    """What the watchdog thread reads of the run."""

    @property
    def policy(self) -> Policy: ...
    @property
    def run_dir(self) -> Path: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def own_loop(self) -> bool: ...
    @property
    def step(self) -> int: ...
    @property
    def events(self) -> EventLog:
        """Thread-safe (one lock per log)."""
        ...

    @property
    def parallel(self) -> ParallelState: ...
    @property
    def deadlines(self) -> Deadlines: ...
    @property
    def ops(self) -> Ops: ...
    @property
    def comms(self) -> Comms: ...
    @property
    def progress(self) -> Progress: ...
    @property
    def compute(self) -> Compute | None: ...


class Watching(Protocol):
    """The watchdog as the sequence check asks it (:class:`lifecycle.watchdog.core.Watchdog`)."""

    progress: ProgressTracker

    def peer_records(self, ranks: list[int]) -> dict[int, JsonDict | None]: ...


class CheckedRun(WatchedRun, Protocol):
    """What the collective-sequence check (a phase hook, on the training thread) reads of the run."""

    @property
    def watchdog(self) -> Watching | None: ...

    def require_store(self) -> Store: ...

