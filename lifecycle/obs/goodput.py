"""Goodput of a run: where the wall time of every attempt went, from rank 0's events (docs/goodput.md).

The wall time runs from the start of the first attempt's rank process to the last event of the last attempt. Every
moment of it falls in exactly one bucket, so the buckets sum to the wall time:

- ``productive``: train steps whose result survives into the final state;
- ``lost``: steps computed and then thrown away — recomputed after a failure (a later attempt, or an in-place
  restart, ran the same step again), or past the last commit of a run that ended failed;
- ``startup``: from the rank process's start (imports) through init and warmup to training;
- ``checkpoint``: the loop waiting on a save (the checkpoint phase; an asynchronous save's background writes are not
  waited for and do not count);
- ``restore``: loading and verifying the checkpoint a run resumes from;
- ``detection``: from the last progress before a failure to the failure's verdict on rank 0 (a crash seen, a hang
  reported);
- ``teardown``: the teardown phase, and everything from a failure's verdict to the attempt's last event;
- ``relaunch``: between one attempt's last event and the next one's rank process start (the launcher's relaunch, a
  scheduler's requeue and wait);
- ``other``: the rest of training (step boundaries, barriers, the stop flag, a trainer's evaluation).

A moment covered by several spans counts once, for the most specific: detection and the failure's teardown, then
restore, a step, the checkpoint phase, the teardown phase, init and warmup. Ranks run in lockstep, so rank 0's
timeline (the lowest rank with events where rank 0 has none) stands for the job's.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifecycle.obs.events import PER_STEP_OPS, iter_file, rank_files
from lifecycle.obs.spans import Span, rank_spans, valid_events
from lifecycle.rundir import ATTEMPTS_DIR, current_attempt

BUCKETS = ("productive", "lost", "startup", "checkpoint", "restore", "detection", "teardown", "relaunch", "other")
# ml-goodput-measurement's names for the buckets that match one of its badput kinds
GOODPUT_MEASUREMENT = {"productive": "productive time", "lost": "wasted progress from disruption",
                       "startup": "TPU initialization + training preparation", "checkpoint": "checkpoint save",
                       "restore": "checkpoint restore", "other": "other"}
_FAILURE = ("failure", "hang_report")
_PRIORITY = {"detection": 7, "failed": 7, "restore": 6, "step": 5, "checkpoint": 4, "teardown": 3, "startup": 2}


@dataclass
class Goodput:
    wall_s: float = 0.0
    buckets: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))
    attempts: int = 0
    failures: int = 0
    steps_productive: int = 0
    steps_lost: int = 0
    segments: list[tuple[int, int, str]] = field(default_factory=list, repr=False)
    """``(start_us, end_us, bucket)`` in time order, adjacent ones of one bucket merged (the timeline's shading)."""

    @property
    def goodput(self) -> float | None:
        return self.buckets["productive"] / self.wall_s if self.wall_s > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {"goodput": None if self.goodput is None else round(self.goodput, 4), "wall_s": round(self.wall_s, 3),
                "buckets_s": {k: round(v, 3) for k, v in self.buckets.items()}, "attempts": self.attempts,
                "failures": self.failures, "steps": {"productive": self.steps_productive, "lost": self.steps_lost}}

    def line(self) -> str:
        """One line: the goodput and the buckets that are not empty."""
        if self.goodput is None:
            return "no training time recorded"
        parts = [f"{k} {v:.1f}s" + (f" ({self.steps_lost} steps)" if k == "lost" and self.steps_lost else "")
                 for k, v in self.buckets.items() if v >= 0.05]
        return (f"{self.goodput:.3f} of {self.wall_s:.1f}s over {self.attempts} attempt"
                f"{'s' if self.attempts != 1 else ''}: " + ", ".join(parts))


@dataclass
class _Attempt:
    number: int
    events: list[dict[str, Any]]
    spans: list[Span]
    start_us: int
    end_us: int
    exit_code: int | None


_UNREAD = tuple(f'"kind": "begin", "name": {json.dumps(n)}'.encode() for n in PER_STEP_OPS)
"""The begin lines of the per-step collectives (three of a step's eight lines): the accounting reads none of their
spans, only when each one ended (the last progress before a failure), so they are not parsed (a rank's last line
still is, :func:`lifecycle.obs.events.iter_file`)."""


def _one_rank(folder: Path) -> tuple[int, list[dict[str, Any]]] | None:
    """The lowest rank of ``folder/events`` with well-formed events, and those events (one file read at a time)."""
    for rank, path in rank_files(folder):
        events = valid_events(list(iter_file(path, needles=_UNREAD)))
        if events:
            return rank, events
    return None


def _attempt(number: int, folder: Path) -> _Attempt | None:
    found = _one_rank(folder)
    if found is None:
        return None
    rank, events = found
    start = min(e["t"] for e in events)
    first = next((e for e in events if e["name"] == "attempt" and e["kind"] == "instant"), None)
    since = first.get("process_start_s") if first else None
    if isinstance(since, int | float) and 0 <= since < 86400:
        start = min(start, first["t"] - int(since * 1e6)) if first else start
    exits = [e for e in events if e["name"] == "exit" and e["kind"] == "instant"]
    code = exits[-1].get("exit_code") if exits else None
    # The spans the buckets use: not the per-step collectives' (their ends stay in ``events``), but the rank's
    # last moment, which ends the spans it never closed
    end = max(events, key=lambda e: e["t"])
    spans = rank_spans(rank, [e for e in events if e["name"] not in PER_STEP_OPS or e is end], valid=True)
    return _Attempt(number, events, spans, start, end["t"], code if isinstance(code, int) else None)


def attempts(run_dir: Path) -> list[_Attempt]:
    """The run's attempts with events, oldest first: the archived ones (``attempts/<n>``), then the current one."""
    run_dir = Path(run_dir)
    out = []
    root = run_dir / ATTEMPTS_DIR
    numbers = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and len(p.name) < 8) \
        if root.is_dir() else []
    for n in numbers:
        a = _attempt(n, root / str(n))
        if a is not None:
            out.append(a)
    current = _attempt(current_attempt(run_dir), run_dir)
    if current is not None and all(a.number != current.number for a in out):
        out.append(current)
    return sorted(out, key=lambda a: a.start_us)


def _failures(a: _Attempt) -> list[tuple[int, int, int]]:
    """``(verdict, idle_us, until)`` per failure of one attempt: the first failure or hang report (with the
    reporting rank's no-progress time, 0 when unknown), until the next in-place restart begins (its ``attempt``
    instant) or the attempt ends."""
    out: list[tuple[int, int, int]] = []
    for e in a.events:
        if e["kind"] != "instant":
            continue
        if e["name"] in _FAILURE and (not out or out[-1][2] != a.end_us):
            idle = e.get("idle_s")
            idle_us = int(idle * 1e6) if isinstance(idle, int | float) and 0 <= idle < 86400 else 0
            out.append((e["t"], idle_us, a.end_us))
        elif e["name"] == "attempt" and e.get("in_process") and out and out[-1][2] == a.end_us:
            out[-1] = (out[-1][0], out[-1][1], e["t"])
    return out


_LABEL = {"step": "step", "resume": "restore", "verify": "restore", "memory_restore": "restore",
          "memory_save": "checkpoint", "memory_wait": "checkpoint", "phase:checkpoint": "checkpoint",
          "phase:teardown": "teardown", "phase:init": "startup", "phase:warmup": "startup"}
Interval = tuple[int, int, str, Span | None]
"""``(start_us, end_us, label, the span it comes from)``: a span, or a failure's detection or teardown window."""


def _intervals(a: _Attempt) -> tuple[list[Interval], int]:
    """The labelled intervals of one attempt, and how many failures it had."""
    out: list[Interval] = [(s.start_us, s.end_us, _LABEL[s.name], s) for s in a.spans if s.name in _LABEL]
    failures = _failures(a)
    ends = sorted(e["t"] for e in a.events if e["kind"] == "end" and not e["name"].startswith("phase:"))
    for verdict, idle_us, until in failures:
        # an op the verdict aborted ends just before it: a hang report's own no-progress time says where it began
        before = [t for t in ends if t <= verdict]
        start = before[-1] if before else a.start_us
        out.append((max(min(start, verdict - idle_us), a.start_us), verdict, "detection", None))
        out.append((verdict, until, "failed", None))
    return out, len(failures)


def _sweep(a: _Attempt, intervals: list[Interval], first_train: int | None,
           step_time: dict[int, float], segments: list[tuple[int, int, str | int]] | None = None) -> dict[str, float]:
    """Assign every µs of ``[a.start_us, a.end_us]`` to one bucket; the seconds of each step interval (by its index)
    to step_time; with ``segments``, each piece as ``(lo, hi, bucket or step interval index)``."""
    out = dict.fromkeys(BUCKETS, 0.0)
    inside = (x for s, e, _, _ in intervals for x in (s, e) if a.start_us <= x <= a.end_us)
    marks = sorted({a.start_us, a.end_us, *inside})
    order = sorted(range(len(intervals)), key=lambda i: intervals[i][0])
    active: list[tuple[int, int, int]] = []  # (-priority, -start, index)
    k = 0
    for lo, hi in zip(marks, marks[1:], strict=False):
        while k < len(order) and intervals[order[k]][0] <= lo:
            s, _, label, _ = intervals[order[k]]
            heapq.heappush(active, (-_PRIORITY[label], -s, order[k]))
            k += 1
        while active and intervals[active[0][2]][1] <= lo:
            heapq.heappop(active)
        # an interval that ended below the top is dropped once it reaches the top
        seconds = (hi - lo) / 1e6
        if active:
            i = active[0][2]
            label = intervals[i][2]
            if label == "step":
                step_time[i] = step_time.get(i, 0.0) + seconds
                if segments is not None:
                    segments.append((lo, hi, i))
                continue
            bucket = "teardown" if label == "failed" else label
        elif first_train is None or lo < first_train:
            bucket = "startup"
        else:
            bucket = "other"
        out[bucket] += seconds
        if segments is not None:
            segments.append((lo, hi, bucket))
    return out


def _from_end(survivors: dict[int, Any], step: int) -> list[int]:
    """The keys of ``survivors`` (rising in insertion order) that are ``>= step``, ascending; read from the end."""
    keys = []
    for key in reversed(survivors):
        if key < step:
            break
        keys.append(key)
    return keys[::-1]


def account(run_dir: Path) -> Goodput:
    """The goodput of the run in ``run_dir`` over every attempt it recorded."""
    runs = attempts(run_dir)
    g = Goodput(attempts=len(runs))
    if not runs:
        return g
    g.wall_s = (runs[-1].end_us - runs[0].start_us) / 1e6
    computations: list[tuple[int, float, bool, tuple[int, int]]] = []  # (step, seconds, completed, (attempt,
    # interval)), in the order they ran
    pieces: list[tuple[int, int, str | tuple[int, int]]] = []
    last_commit: int | None = None
    for n, a in enumerate(runs):
        if n:
            g.buckets["relaunch"] += max(a.start_us - runs[n - 1].end_us, 0) / 1e6
            if a.start_us > runs[n - 1].end_us:
                pieces.append((runs[n - 1].end_us, a.start_us, "relaunch"))
        intervals, failures = _intervals(a)
        g.failures += failures
        trains = [s.start_us for s in a.spans if s.name == "phase:train"]
        step_time: dict[int, float] = {}
        segs: list[tuple[int, int, str | int]] = []
        for bucket, seconds in _sweep(a, intervals, min(trains) if trains else None, step_time, segs).items():
            g.buckets[bucket] += seconds
        pieces += [(lo, hi, (n, what) if isinstance(what, int) else what) for lo, hi, what in segs]
        for i, (_, _, label, span) in enumerate(intervals):  # spans in start order: the steps as they ran
            if label != "step" or span is None:
                continue
            step = span.begin.get("step")
            if isinstance(step, int):
                computations.append((step, step_time.get(i, 0.0), not span.cut, (n, i)))
            else:
                g.buckets["other"] += step_time.get(i, 0.0)
        for s in a.spans:
            if s.name == "commit" and not s.cut and (s.end or {}).get("outcome", "ok") == "ok":
                step = s.begin.get("step")
                if isinstance(step, int):
                    last_commit = step if last_commit is None else max(last_commit, step)
    survivors: dict[int, tuple[float, tuple[int, int]]] = {}
    outcome: dict[tuple[int, int], str] = {}
    for step, seconds, completed, key in computations:
        # the same step again: the results from it on were thrown away. The survivors' steps rise in insertion order
        # (each one goes in after every step >= it went out), so they go from the end: linear in the steps run
        for later in _from_end(survivors, step):
            lost, was = survivors.pop(later)
            g.buckets["lost"] += lost
            g.steps_lost += 1
            outcome[was] = "lost"
        if completed:
            survivors[step] = (seconds, key)
        else:
            g.buckets["lost"] += seconds
            g.steps_lost += 1
            outcome[key] = "lost"
    ended_failed = runs[-1].exit_code not in (0, None)
    for step, (seconds, key) in survivors.items():
        if ended_failed and (last_commit is None or step > last_commit):
            g.buckets["lost"] += seconds
            g.steps_lost += 1
            outcome[key] = "lost"
        else:
            g.buckets["productive"] += seconds
            g.steps_productive += 1
            outcome[key] = "productive"
    for lo, hi, what in pieces:
        bucket = what if isinstance(what, str) else outcome.get(what, "other")
        if g.segments and g.segments[-1][2] == bucket and g.segments[-1][1] == lo:
            g.segments[-1] = (g.segments[-1][0], hi, bucket)
        else:
            g.segments.append((lo, hi, bucket))
    return g

