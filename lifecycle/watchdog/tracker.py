"""This rank's progress as the watchdog sees it: a local slot fed by the EventLog, read by the watchdog thread.

The EventLog calls :meth:`ProgressTracker.on_event` for every event it records, on the thread that emits it
(the training thread). The work there is O(1) and touches no store and no file: a lock, a counter and a
tuple. The watchdog thread takes a :meth:`ProgressTracker.record` snapshot at every poll and publishes it.

What is tracked (all from ``begin``/``end`` span events):

- the phase (``phase`` of the latest event) and the train step;
- the open spans (``init_process_group``, ``warm:all_reduce``, ``step``, ``save`` ...), innermost last;
- per group label, how many spans this rank has *begun* on that group (its sequence number there).
  Spans without a group count on ``world``: every rank runs them in the same order (plan order), so
  on any group, a member whose count is below mine has not reached the op I am in;
- the time of the last begin/end (the watchdog measures the phase deadline from it);
- once the rank has been idle a while, where its training thread is blocked (:func:`blocked_in`): inside a
  ``torch.distributed`` call (waiting for peers, whatever lifecycle traces) or in its own code. A rank frozen in its
  own code is the one its peers wait for, even when the collective they wait in is one lifecycle does not see (a
  MoE all-to-all, a tensor-parallel all-reduce): the diagnosis names only it.

Phase begins (``phase:<name>``) count as ``world`` ops too, so a rank stuck at a phase entry is seen
behind the ranks that already started the phase's first op.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from lifecycle.jsontypes import Json, JsonDict

WORLD = "world"
BLOCKED_AFTER_S = 1.0
"""Idle this long, a rank's record says where its training thread is blocked (:func:`blocked_in`)."""
_WAITING = ("/torch/distributed/", "/torch/cuda/streams.py", "/torch/cuda/__init__.py",
            "/megatron/core/tensor_parallel/mappings.py", "/megatron/core/pipeline_parallel/p2p_communication.py",
            "/megatron/core/distributed/param_and_grad_buffer.py", "/lifecycle/distributed/collectives.py")
"""Frames of code that waits for peers or the device (torch's collectives and the wrappers that wait on their
handles): a thread inside one is waiting, not stuck in its own code."""


def blocked_in(thread_id: int) -> str | None:
    """Where the thread is: ``collective`` when one of its frames is in ``torch.distributed`` (or a CUDA
    synchronize: on NCCL a host waits for a collective there), else ``own code``; None when it is gone. Read from
    another thread (a snapshot of its frames; no lock of the training thread's is taken)."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return None
    depth = 0
    while frame is not None and depth < 200:
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(part in name for part in _WAITING):
            return "collective"
        frame, depth = frame.f_back, depth + 1
    return "own code"


def deadline_key(phase: str) -> str:
    """The ``watchdog.deadlines`` key that bounds ``phase`` (``step`` bounds each step of the train phase). The one
    place a phase name becomes a deadline name; nothing maps back."""
    return "step" if phase == "train" else phase


class Op(NamedTuple):
    """One begun span: its name, group label, sequence number on that group, step, member ranks (or None), and the
    deadline that bounds it when not its phase's (the span's ``deadline`` field: ``setup``, ``eval``, ``checkpoint``)."""

    name: str
    group: str
    seq: int
    step: int | None
    ranks: list[int] | None
    bound: str | None = None

    def short(self) -> list[Json]:
        return [self.name, self.group, self.seq, self.step]


class ProgressTracker:
    """The progress slot of one rank (thread-safe; ``on_event`` is the only writer of the op state)."""

    def __init__(self, rank: int, *, extra: Callable[[], JsonDict] | None = None,
                 members: Callable[[str], list[int] | None] | None = None) -> None:
        self.rank = rank
        self.extra = extra
        """Called at snapshot time (watchdog thread) for fields read from elsewhere (op counts, store keys)."""
        self.members = members
        """Member ranks of a group label, for spans whose event has no ``ranks``; called once per label,
        on the thread that emits the span (never on the watchdog thread: it must not import or call
        into torch/megatron while the training thread may be importing them)."""
        self._members: dict[str, list[int] | None] = {WORLD: None, "store": None}
        self._lock = threading.Lock()
        self.phase = "init"
        self.step: int | None = None
        self.open: list[Op] = []
        self.last: Op | None = None
        self.broken: Op | None = None
        self.begun: Counter[str] = Counter()
        self.t_progress = time.monotonic()
        self.state = "running"
        self.error: str | None = None
        self.thread: int | None = None
        """The thread that emits the spans (the training thread)."""
        self.blocked: str | None = None
        """Where that thread was blocked when last looked at while idle and running (kept once the rank stops:
        the position it was stuck in)."""

    def on_event(self, event: JsonDict) -> None:
        """EventLog listener: O(1), no I/O."""
        kind = event["kind"]
        if kind != "begin" and kind != "end":
            return
        name = event["name"]
        now = time.monotonic()
        with self._lock:
            if self.state != "running":
                return  # keep the position where this rank failed (its teardown is not progress)
            self.phase = event["phase"]
            self.step = event.get("step")
            self.t_progress = now
            self.thread = threading.get_ident()
            self.blocked = None
            if kind == "end":
                closed = self._close(name)
                if closed is not None and event.get("outcome", "ok") != "ok":
                    self.broken = closed  # an op left by an exception is where this rank was stuck
                return
            self.broken = None
            group = event.get("group") or WORLD
            seq = self.begun[group] + 1
            self.begun[group] = seq
            op = Op(name, group, seq, self.step, event.get("ranks") or self._ranks(group), event.get("deadline"))
            self.last = op
            if not name.startswith("phase:"):
                self.open.append(op)

    def _ranks(self, group: str) -> list[int] | None:
        if group not in self._members:
            try:
                self._members[group] = self.members(group) if self.members is not None else None
            except Exception:  # noqa: BLE001 - a listener must never break the training thread
                self._members[group] = None
        return self._members[group]

    def _close(self, name: str) -> Op | None:
        for i in range(len(self.open) - 1, -1, -1):
            if self.open[i].name == name:
                op = self.open[i]
                del self.open[i:]
                return op
        return None

    def set_state(self, state: str, error: str | None = None) -> None:
        with self._lock:
            self.state, self.error = state, error

    def idle_s(self) -> float:
        """Seconds since the last begin/end on this rank."""
        return time.monotonic() - self.t_progress

    def bound(self) -> str:
        """The deadline key that bounds this rank now: the innermost open span's own (a trainer's set-up or
        evaluation, a resume), else its phase's."""
        with self._lock:
            inner = self.open[-1] if self.open else None
            return inner.bound if inner is not None and inner.bound else deadline_key(self.phase)

    def _op(self) -> Op | None:
        return self.open[-1] if self.open else self.broken

    def waiting_in(self) -> Op | None:
        """The innermost open span (None between ops or after a failure)."""
        with self._lock:
            return self.open[-1] if self.open and self.state == "running" else None

    def current(self) -> Op | None:
        """The innermost open span (or the one an exception left), else the last one begun."""
        with self._lock:
            return self._op() or self.last

    def record(self) -> JsonDict:
        """A JSON-able snapshot for the store (the watchdog thread calls it at every poll)."""
        with self._lock:
            op = self._op()
            shown = op or self.last
            rec: JsonDict = {
                "rank": self.rank, "state": self.state, "phase": self.phase, "step": self.step,
                "op": op.short() if op else None, "last": self.last.short() if self.last else None,
                "ranks": shown.ranks if shown is not None else None,
                "begun": dict(self.begun), "idle_s": round(time.monotonic() - self.t_progress, 3),
                "t": time.time(), "error": self.error,
            }
            thread, idle = self.thread, time.monotonic() - self.t_progress
        if thread is not None and idle >= BLOCKED_AFTER_S and rec["state"] == "running":
            self.blocked = blocked_in(thread)
        if self.blocked is not None:
            rec["blocked"] = self.blocked
        if self.extra is not None:
            rec.update(self.extra())
        return rec
