"""The per-rank state shared by the phases of one run: one typed dataclass.

The worker builds it (policy, run directory, rank, events, drills, the model-parallel backend) and the
orchestrator hands it to every phase. Fields that phases fill in as the run goes (the store, the
resolved groups, the step handler, the pending save ...) start empty.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lifecycle.policy.base import deadline_phase

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from lifecycle.checkpoint.pending import PendingSave
    from lifecycle.distributed.faults import Drills
    from lifecycle.distributed.groups import ResolvedGroup
    from lifecycle.distributed.parallel import ParallelState
    from lifecycle.handlers.protocols import StepHandler
    from lifecycle.jsontypes import JsonDict
    from lifecycle.obs.events import EventLog
    from lifecycle.policy.schema import Policy
    from lifecycle.watchdog.adaptive import AdaptiveDeadline, Derivation
    from lifecycle.watchdog.diagnosis import Diagnosis
    from lifecycle.watchdog.straggler import ComputeWindow
    from lifecycle.watchdog.tracker import ProgressTracker

ADAPTIVE = ("train", "checkpoint", "eval")
"""The deadlines that can be ``auto``, in the order their proposals ride on the stop-flag all-reduce."""

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

    def stop(self) -> None: ...


@dataclass
class StopState:
    """Why and when the run should stop early."""

    preempt_signal: str | None = None
    """Signal name once a preemption signal arrived on this rank."""
    stop_step: int | None = None
    """The step all ranks agreed to stop at (after saving)."""


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
    parallel: ParallelState
    """The model-parallel backend (Megatron's ``parallel_state`` in a real run)."""
    attempt: int = 1
    """Which run of the same command in the same run directory this is (1 for a new run)."""
    own_loop: bool = False
    """A trainer's own loop (``lifecycle.attach``): the policy's train kind does not say which groups it uses."""
    adopted_world: bool = False
    """The default process group was the trainer's (made before ``attach``): lifecycle never aborts or destroys it."""
    adopted_groups: bool = False
    """The model-parallel groups were the trainer's: lifecycle never destroys them."""
    started_attempt: bool = False
    """Rank 0 recorded this attempt's start in the restart ledger (at init): it records the end too."""
    restarts_left: int = 0
    """Restarts this job may still make (``restart.max_restarts`` less those made): an in-process one takes one."""
    restart_round: int = 0
    """In-process restarts this process made: the store prefix of its process groups and watchdog keys."""
    restart_base: Store | None = None
    """The store the process groups of an in-process restart are re-created on (the previous round's)."""
    store: Store | None = None
    """The default group's store (set by init); barriers and checkpoint agreement use it."""
    groups: list[ResolvedGroup] = field(default_factory=list)
    """This rank's communicators resolved by warmup (names, process group, ranks)."""
    step_handler: StepHandler | None = None
    step: int = 0
    """The last completed train step (0 before training; resume sets it)."""
    stop: StopState = field(default_factory=StopState)
    pending_save: PendingSave | None = None
    """An async checkpoint not yet committed."""
    saved: list[str] = field(default_factory=list)
    """Committed checkpoint paths of this run."""
    resumed_from: int | None = None
    op_counts: Counter[str] = field(default_factory=Counter)
    """Collectives issued per group label (for the sequence check)."""
    warmup_s: dict[str, float] = field(default_factory=dict)
    """Seconds spent warming each group label (for the exit event)."""
    phase_hooks: list[PhaseHook] = field(default_factory=list)
    """Run at every transition (all ranks, same order)."""
    watchdog: WatchdogHandle | None = None
    ckpt_group: ProcessGroup | None = None
    """The dedicated gloo group of ``checkpoint.coordination: gloo`` (created at the first save)."""
    keys_taken: int = 0
    """Store keys taken so far: ranks take them in plan order, so a rank with fewer is behind (the watchdog
    publishes it)."""
    adaptive: dict[str, AdaptiveDeadline] = field(default_factory=dict)
    """Phases (``train``, ``checkpoint``) whose deadline is ``auto``: the model that derives it."""
    compute: ComputeWindow | None = None
    """This rank's recent step compute times (the straggler check reads their median from its record)."""

    def span(self, name: str, **fields: object) -> AbstractContextManager[JsonDict]:
        """A begin/end span on this rank's events (:class:`~lifecycle.handlers.protocols.StepContext`)."""
        return self.events.span(name, **fields)

    def instant(self, name: str, **fields: object) -> None:
        self.events.instant(name, **fields)

    def count_op(self, group: str) -> None:
        """One collective issued on ``group`` (the sequence check compares the counts across ranks)."""
        self.op_counts[group] += 1

    def next_key(self, name: str) -> str:
        """A store key unique per call and identical on every rank (calls happen in plan order)."""
        self.keys_taken += 1
        return f"lifecycle/{name}/{self.keys_taken - 1}"

    def deadline(self, phase: str) -> float:
        """The deadline of ``phase`` now: the agreed adaptive value for an ``auto`` phase, else the policy's."""
        model = self.adaptive.get(deadline_phase(phase))
        return model.effective() if model is not None else self.policy.deadline(phase)

    def derivation(self, phase: str) -> Derivation | None:
        """How an ``auto`` deadline came about (None for a static one)."""
        model = self.adaptive.get(deadline_phase(phase))
        return model.derivation() if model is not None else None

    def observe(self, phase: str, seconds: float) -> None:
        """One duration the ``phase`` deadline bounds (a step, a checkpoint span)."""
        model = self.adaptive.get(phase)
        if model is not None:
            model.observe(seconds)

    def deadline_proposals(self) -> list[float]:
        """This rank's proposals for the adaptive deadlines, in a fixed order (:data:`ADAPTIVE`)."""
        return [self.adaptive[p].proposal() if p in self.adaptive else 0.0 for p in ADAPTIVE]

    def agree_deadlines(self, agreed: list[float]) -> None:
        """Every rank calls it with the same values: the maximum of every rank's proposals."""
        for phase, value in zip(ADAPTIVE, agreed, strict=True):
            model = self.adaptive.get(phase)
            if model is not None:
                before = model.effective()
                model.agree(value)
                after = model.effective()
                if abs(after - before) > 0.05 * before:
                    how = model.derivation()
                    self.events.instant("deadline", deadline_phase=phase, seconds=round(after, 4), how=how.text,
                                        adaptive=how.adaptive)

    def require_store(self) -> Store:
        """The store, or a clear error when init has not set it."""
        if self.store is None:
            from lifecycle.errors import PhaseError

            raise PhaseError("no store: the default process group is not initialized on this rank",
                             rank=self.rank)
        return self.store
