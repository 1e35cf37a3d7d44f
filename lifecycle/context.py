"""One rank's run, in parts that each have one owner.

- :class:`Identity` — rank, world, policy, run directory, attempt, own loop. Frozen; init swaps in the agreed
  attempt once (:meth:`RunContext.agree_attempt`).
- :class:`Communicators` — the store, the warmed groups, the checkpoint group, whose groups they are. Changed by the
  init and warmup phases, the checkpoint coordination (its gloo group) and teardown.
- :class:`Progress` — the step, the stop request, the pending save, what was committed, the resume, the restart
  ledger's bookkeeping. Changed by the training thread: the train and checkpoint phases, the resume and commit, a
  trainer's ``Job``.
- :class:`DeadlineBook` — the deadlines by ``watchdog.deadlines`` key, the learned ones included. Made with the
  watchdog; the training thread feeds it (observe, agree).
- :class:`OpCounter` — collectives issued per group label, store keys taken. The training thread counts.

The watchdog thread reads the identity (frozen), the deadline book and the op counter (both under their own lock;
the counter as a :meth:`OpCounter.snapshot`), the warmed groups (a tuple, replaced whole) and the step (an int).
``tests/unit/test_context.py`` holds the owners and the thread rule.

The one name of a deadline is its ``watchdog.deadlines`` key: ``step`` bounds each step of the train phase
(:func:`lifecycle.watchdog.tracker.deadline_key` says which key bounds a phase; nothing maps a key back to a phase).
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from lifecycle.policy.base import check_deadline_key

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from lifecycle.distributed.faults import Drills
    from lifecycle.distributed.groups import ResolvedGroup
    from lifecycle.distributed.parallel import ParallelState
    from lifecycle.handlers.protocols import SaveHandle, StepHandler
    from lifecycle.jsontypes import JsonDict
    from lifecycle.obs.events import EventLog
    from lifecycle.policy.schema import Policy
    from lifecycle.watchdog.adaptive import AdaptiveDeadline, Derivation
    from lifecycle.watchdog.diagnosis import Diagnosis
    from lifecycle.watchdog.straggler import ComputeWindow
    from lifecycle.watchdog.tracker import ProgressTracker

ADAPTIVE = ("step", "checkpoint", "eval")
"""The deadline keys that can be ``auto``, in the order their proposals ride on the stop-flag all-reduce."""

PhaseHook = Callable[["RunContext", "str | None", str, bool], None]
"""``hook(ctx, old_phase, new_phase, failure)``, run at every transition (all ranks, same order)."""


class WatchdogHandle(Protocol):
    """What the engine asks of the watchdog thread (:class:`lifecycle.watchdog.core.Watchdog`)."""

    reported: Diagnosis | None
    """This rank's report, once it made one."""
    progress: ProgressTracker
    """What this rank is doing (the op it waits in, the ops it began per group)."""
    @property
    def restart_request(self) -> object | None:
        """A peer failed and asked for a restart in place (``restart.mode: in_process``): the training thread
        leaves its phase at the next step boundary."""
        ...

    def peer_records(self, ranks: list[int]) -> dict[int, JsonDict | None]:
        """The heartbeat records of ``ranks`` (None for one without a record)."""
        ...

    def on_failure(self, exc: BaseException) -> BaseException:
        """A phase failed with ``exc``: tell the peers, report who is stuck; the error the run ends with."""
        ...

    def wake(self) -> None:
        """Look for a cause now, not at the next poll (any thread)."""
        ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Identity:
    """Who this rank is in which run. Frozen: the watchdog thread reads it without a lock."""

    policy: Policy
    run_dir: Path
    rank: int
    world_size: int
    local_rank: int
    attempt: int = 1
    """Which run of the same command in the same run directory this is (1 for a new run); agreed at init."""
    own_loop: bool = False
    """A trainer's own loop (``lifecycle.attach``): the policy's train kind does not say which groups it uses."""


class TierHandle(Protocol):
    """What teardown needs of the memory tier (:class:`lifecycle.recovery.memory.MemoryTier`)."""

    def release_groups(self) -> list[ProcessGroup]: ...

    def close(self, ctx: RunContext, *, finished: bool, wait_s: float | None = None) -> None: ...


@dataclass
class Communicators:
    """This rank's communicators and whose they are. Changed by init (store, adoption), warmup (groups), the
    checkpoint coordination and the memory tier (their gloo groups) and teardown (releases); fixed per in-process
    restart round."""

    restart_round: int = 0
    """In-process restarts this process made: the store prefix of its process groups and watchdog keys."""
    restart_base: Store | None = None
    """The store the process groups of an in-process restart are re-created on (the previous round's)."""
    store: Store | None = None
    """The default group's store (set by init); barriers and checkpoint agreement use it."""
    groups: tuple[ResolvedGroup, ...] = ()
    """This rank's communicators resolved by warmup (names, process group, ranks); replaced whole, never edited in
    place (the watchdog thread reads it)."""
    ckpt_group: ProcessGroup | None = None
    """The dedicated gloo group of ``checkpoint.coordination: gloo`` (created at the first save)."""
    memory: TierHandle | None = None
    """The round's in-memory checkpoint tier (:class:`lifecycle.recovery.memory.MemoryTier`: its pair groups and the
    copy in flight), made at the start of training when ``checkpoint.memory.every_steps`` is set."""
    adopted_world: bool = False
    """The default process group was the trainer's (made before ``attach``): lifecycle never aborts or destroys it."""
    adopted_groups: bool = False
    """The model-parallel groups were the trainer's: lifecycle never destroys them."""

    def require_store(self, rank: int) -> Store:
        """The store, or a clear error when init has not set it."""
        if self.store is None:
            from lifecycle.errors import PhaseError

            raise PhaseError("no store: the default process group is not initialized on this rank", rank=rank)
        return self.store


@dataclass
class StopState:
    """Why and when the run should stop early."""

    preempt_signal: str | None = None
    """Signal name once a preemption signal arrived on this rank (set by the signal handler, on the training
    thread: Python runs handlers there)."""
    stop_step: int | None = None
    """The step all ranks agreed to stop at (after saving)."""


@dataclass
class PendingSave:
    """A save begun and not yet committed (an async save's handle until the next step boundary)."""

    handle: SaveHandle
    step: int
    tmp: Path
    """The ``iter_NNNNNNN.tmp`` folder being written."""
    final: Path
    """Where the commit renames it."""
    reason: str
    loss: float | None = None
    """The loss of the saved step (recorded in the manifest: the first step after a restore is checked against it)."""


@dataclass
class Progress:
    """Where training stands. Changed by the training thread only: the train and checkpoint phases, the resume, the
    checkpoint commit, a trainer's :class:`lifecycle.machine.job.Job`; the watchdog thread reads ``step`` (an int)."""

    step: int = 0
    """The last completed train step (0 before training; resume sets it)."""
    stop: StopState = field(default_factory=StopState)
    pending_save: PendingSave | None = None
    """An async checkpoint not yet committed."""
    saved: list[str] = field(default_factory=list)
    """Committed checkpoint paths of this run."""
    resumed_from: int | None = None
    resumed_tier: str | None = None
    """Where ``resumed_from`` came from: ``persistent`` (a committed checkpoint) or ``memory`` (the memory tier's
    copies: not committed, so the resumed step still needs its persistent save)."""
    last_loss: float | None = None
    """The loss the last completed step reported (recorded with the state saved at it)."""
    restored: tuple[str, str, float | None] | None = None
    """What the first step after a restore is checked against (``checkpoint.check_restore``): the tier, the state's
    key in it (a commit's folder name; lineage:step of the memory tier) and the loss recorded at save."""
    warmup_s: dict[str, float] = field(default_factory=dict)
    """Seconds spent warming each group label (for the exit event)."""
    started_attempt: bool = False
    """Rank 0 recorded this attempt's start in the restart ledger (at init): it records the end too."""
    restarts_left: int = 0
    """Restarts this job may still make (``restart.max_restarts`` less those made): an in-process one takes one."""


class DeadlineBook:
    """The watchdog's deadlines by ``watchdog.deadlines`` key (``init``, ``warmup``, ``step``, ``checkpoint``,
    ``eval``, ``setup``, ``teardown``): the policy's, or the agreed learned value of an ``auto`` one.

    The learned models are fixed when the book is made (with the watchdog, before the first phase); the training
    thread feeds them (:meth:`observe`, :meth:`agree`) and the watchdog thread reads them (:meth:`deadline`,
    :meth:`derivation`); each model holds its own lock.
    """

    def __init__(self, policy: Policy, learned: Mapping[str, AdaptiveDeadline] | None = None) -> None:
        unknown = sorted(set(learned or {}) - set(ADAPTIVE))
        if unknown:
            raise ValueError(f"not an adaptive deadline key: {unknown} (one of {ADAPTIVE})")
        self._policy = policy
        self.learned: Mapping[str, AdaptiveDeadline] = MappingProxyType(dict(learned or {}))

    def deadline(self, key: str) -> float:
        """The deadline of ``key`` now: the agreed learned value of an ``auto`` one, else the policy's (which refuses
        a name that is not a key)."""
        model = self.learned.get(key)
        return model.effective() if model is not None else self._policy.deadline(key)

    def derivation(self, key: str) -> Derivation | None:
        """How an ``auto`` deadline came about (None for a static one)."""
        model = self.learned.get(check_deadline_key(key))
        return model.derivation() if model is not None else None

    def observe(self, key: str, seconds: float) -> None:
        """One duration the ``key`` deadline bounds (a step, a checkpoint span)."""
        model = self.learned.get(check_deadline_key(key))
        if model is not None:
            model.observe(seconds)

    def proposals(self) -> list[float]:
        """This rank's proposals for the learned deadlines, in a fixed order (:data:`ADAPTIVE`)."""
        return [self.learned[k].proposal() if k in self.learned else 0.0 for k in ADAPTIVE]

    def agree(self, agreed: list[float]) -> list[tuple[str, Derivation]]:
        """Every rank calls it with the same values (the maximum of every rank's proposals); the deadlines that
        moved by more than 5 %, with how."""
        moved = []
        for key, value in zip(ADAPTIVE, agreed, strict=True):
            model = self.learned.get(key)
            if model is not None:
                before = model.effective()
                model.agree(value)
                if abs(model.effective() - before) > 0.05 * before:
                    moved.append((key, model.derivation()))
        return moved


class OpCounter:
    """Collectives issued per group label (the sequence check compares them across ranks) and store keys taken
    (ranks take them in plan order, so a rank with fewer is behind). The training thread counts; the watchdog
    thread reads a :meth:`snapshot` (under the same lock)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._keys = 0
        self._lock = threading.Lock()

    def count(self, group: str) -> None:
        """One collective issued on ``group``."""
        with self._lock:
            self._counts[group] += 1

    def next_key(self, name: str) -> str:
        """A store key unique per call and identical on every rank (calls happen in plan order)."""
        with self._lock:
            self._keys += 1
            return f"lifecycle/{name}/{self._keys - 1}"

    def snapshot(self) -> tuple[dict[str, int], int]:
        """The counts per label and the keys taken, read together."""
        with self._lock:
            return dict(self._counts), self._keys


class RunContext:
    """One rank's run: its parts (:class:`Identity`, :class:`Communicators`, :class:`Progress`,
    :class:`DeadlineBook`, :class:`OpCounter`) and what the session attaches (events, drills, the model-parallel
    backend, the step handler, the phase hooks, the watchdog, the compute window).

    It is also the :class:`~lifecycle.handlers.protocols.StepContext` a step handler sees: read-only ``rank``,
    ``world_size``, ``step``, ``attempt``, ``policy``, ``parallel``, and ``deadline``/``span``/``instant``/``count_op``.
    """

    def __init__(self, identity: Identity, events: EventLog, drills: Drills, parallel: ParallelState, *,
                 comms: Communicators | None = None, progress: Progress | None = None,
                 deadlines: DeadlineBook | None = None) -> None:
        self._identity = identity
        self.events = events
        self.drills = drills
        self.parallel = parallel
        """The model-parallel backend (Megatron's ``parallel_state`` in a real run)."""
        self.comms = comms or Communicators()
        self.progress = progress or Progress()
        self.deadlines = deadlines or DeadlineBook(identity.policy)
        self.ops = OpCounter()
        self.step_handler: StepHandler | None = None
        self.phase_hooks: list[PhaseHook] = []
        """Run at every transition (all ranks, same order)."""
        self.watchdog: WatchdogHandle | None = None
        self.compute: ComputeWindow | None = None
        """This rank's recent step compute times (the straggler check reads their median from its record)."""

    @classmethod
    def of(cls, policy: Policy, run_dir: Path, rank: int, world_size: int, local_rank: int, events: EventLog,
           drills: Drills, parallel: ParallelState, *, attempt: int = 1, own_loop: bool = False,
           restarts_left: int = 0, store: Store | None = None) -> RunContext:
        """A first-round context from its parts' values."""
        return cls(Identity(policy, run_dir, rank, world_size, local_rank, attempt, own_loop), events, drills,
                   parallel, comms=Communicators(store=store), progress=Progress(restarts_left=restarts_left))

    # ---- the identity (read-only) ------------------------------------------------------------------------------
    @property
    def identity(self) -> Identity:
        return self._identity

    @property
    def policy(self) -> Policy:
        return self._identity.policy

    @property
    def run_dir(self) -> Path:
        return self._identity.run_dir

    @property
    def rank(self) -> int:
        return self._identity.rank

    @property
    def world_size(self) -> int:
        return self._identity.world_size

    @property
    def local_rank(self) -> int:
        return self._identity.local_rank

    @property
    def attempt(self) -> int:
        return self._identity.attempt

    @property
    def own_loop(self) -> bool:
        return self._identity.own_loop

    def agree_attempt(self, attempt: int) -> None:
        """Init, once: the attempt every rank agreed on (a rank may have counted another from its files)."""
        self._identity = replace(self._identity, attempt=attempt)
        self.drills.attempt = attempt

    # ---- what a step handler sees ------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The last completed train step (:attr:`Progress.step`)."""
        return self.progress.step

    def deadline(self, key: str) -> float:
        """The deadline of ``key`` (a ``watchdog.deadlines`` key; ``step``: one train step) now.

        ``train`` (the phase, not a key) still reads as ``step`` for step handlers written before the keys were the
        one name, with a DeprecationWarning.
        """
        if key == "train":
            warnings.warn("ctx.deadline('train') is deprecated: the step deadline's name is 'step' (the "
                          "watchdog.deadlines key)", DeprecationWarning, stacklevel=2)
            key = "step"
        return self.deadlines.deadline(key)

    def span(self, name: str, **fields: object) -> AbstractContextManager[JsonDict]:
        """A begin/end span on this rank's events (:class:`~lifecycle.handlers.protocols.StepContext`)."""
        return self.events.span(name, **fields)

    def instant(self, name: str, **fields: object) -> None:
        self.events.instant(name, **fields)

    def count_op(self, group: str) -> None:
        """One collective issued on ``group`` (the sequence check compares the counts across ranks)."""
        self.ops.count(group)

    # ---- conveniences over the parts ---------------------------------------------------------------------------
    def require_store(self) -> Store:
        """The store, or a clear error when init has not set it."""
        return self.comms.require_store(self.rank)

    def require_step_handler(self) -> StepHandler:
        """The train kind's step handler, or a clear error where there is none (checkpoints need steps)."""
        if self.step_handler is None:
            from lifecycle.errors import PhaseError

            raise PhaseError("no step handler: checkpoints need train.steps > 0", phase="checkpoint", rank=self.rank)
        return self.step_handler

    def agree_deadlines(self, agreed: list[float]) -> None:
        """Every rank calls it with the same values: the maximum of every rank's proposals; a ``deadline`` event
        for each that moved."""
        for key, how in self.deadlines.agree(agreed):
            self.events.instant("deadline", deadline=key, seconds=round(how.seconds, 4), how=how.text,
                                adaptive=how.adaptive)
