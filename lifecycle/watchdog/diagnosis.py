"""Who is stuck, from the progress records every rank publishes on the store (pure Python, no torch).

A record (see :class:`lifecycle.watchdog.tracker.ProgressTracker.record`) says where a rank is: its phase and
step, its open op (or the last one it began) with the op's group label, the op's sequence number on
that group (``seq``) and the group's member ranks, how many ops it has begun per group (``begun``),
how many store sync points it has passed (``sync``), its state and when it last published (``t``).

For every live rank waiting in (or after) an op on group ``G`` with sequence number ``k``, the
members whose ``begun[G]`` is below ``k`` have not reached that op: they are its *missing* ranks.
A rank that others wait for and that waits for nobody itself (or that is dead) is a *culprit*: the
root of the hang. Ranks that passed fewer store sync points than the others (checkpoint and barrier
keys, taken in plan order) are behind too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lifecycle.distributed.ranks import fmt_ranks
from lifecycle.jsontypes import JsonDict

if TYPE_CHECKING:
    from lifecycle.watchdog.tracker import Op

CAUSES = {
    "hang": "HANG",
    "dead": "RANK DIED",
    "unresponsive": "RANK UNRESPONSIVE",
    "failed": "RANK FAILED",
    "sequence": "COLLECTIVE SEQUENCE MISMATCH",
    "usage": "CONFIGURATION ERROR",
    "lost": "SIDE CHANNEL LOST",
}
ALL_RANKS = ("world", "store")


@dataclass
class Wait:
    """What one rank is waiting in (or last began) and which members of that group have not reached it."""

    op: str
    group: str
    seq: int
    step: int | None
    members: list[int]
    missing: list[int]
    open: bool

    def describe(self) -> str:
        where = "waits in" if self.open else "is past"
        step = f" at step {self.step}" if self.step is not None else ""
        arrived = [m for m in self.members if m not in self.missing]
        return (f"{where} {self.op} on group {self.group} (op #{self.seq} on {self.group}){step}: "
                f"arrived [{fmt_ranks(arrived)}], missing [{fmt_ranks(self.missing)}]")


@dataclass
class Diagnosis:
    """The verdict of one report: the cause, who waits for whom, the culprits and the dead."""

    cause: str
    detail: str
    origin: int | None
    phase: str | None
    waits: dict[int, Wait] = field(default_factory=dict)
    culprits: list[int] = field(default_factory=list)
    dead: dict[int, str] = field(default_factory=dict)
    records: dict[int, JsonDict | None] = field(default_factory=dict)
    lagging: dict[int, int] = field(default_factory=dict)
    """Ranks behind on the store sync points (checkpoint and barrier keys): rank -> points passed."""
    now: float = 0.0
    """Wall-clock time of the diagnosis (records carry the writer's wall-clock ``t``)."""
    unreachable: str | None = None
    """Why the peers could not be asked (the store does not answer): then nobody is named stuck."""

    def to_json(self) -> JsonDict:
        return {
            "t": self.now, "cause": self.cause, "detail": self.detail, "origin_rank": self.origin, "phase": self.phase,
            "culprits": self.culprits, "dead": {str(r): how for r, how in self.dead.items()},
            "peers_unreachable": self.unreachable,
            "waits": {str(r): {**vars(w)} for r, w in self.waits.items()},
            "ranks": {str(r): rec for r, rec in self.records.items()},
        }


def _behind(rec: JsonDict | None, group: str, seq: int) -> bool:
    return rec is None or int(rec.get("begun", {}).get(group, 0)) < seq


def _wait_of(rank: int, rec: JsonDict, records: dict[int, JsonDict | None],
             world: int) -> Wait | None:
    op = rec.get("op") or rec.get("last")
    if not op:
        return None
    name, group, seq, step = op
    members = rec.get("ranks") or (list(range(world)) if group in ALL_RANKS else None)
    if not members:
        return None
    missing = [m for m in members if m != rank and _behind(records.get(m), group, seq)]
    return Wait(name, group, seq, step, list(members), missing, rec.get("op") is not None)


def _left_reporting_a_hang(rec: JsonDict | None) -> bool:
    """The rank's own watchdog took it down for a hang (``state aborted``, ``watchdog: hang``)."""
    return rec is not None and rec.get("state") == "aborted" and str(rec.get("error") or "") == "watchdog: hang"


def stale_ranks(records: dict[int, JsonDict | None], now: float, stale_s: float) -> dict[int, str]:
    """Running ranks whose last record is older than ``stale_s`` (by the wall clock of the writer)."""
    out = {}
    for r, rec in records.items():
        if rec is not None and rec.get("state") == "running" and now - float(rec.get("t", now)) > stale_s:
            out[r] = f"no heartbeat for {now - float(rec['t']):.1f}s"
    return out


def diagnose(cause: str, detail: str, records: dict[int, JsonDict | None], world: int, *,
             dead: dict[int, str] | None = None, origin: int | None = None, phase: str | None = None,
             hint: list[int] | None = None, now: float = 0.0, unreachable: str | None = None) -> Diagnosis:
    """Build the verdict from the records of the ranks read (``None``: the rank published nothing).

    ``hint`` lists ranks an op that timed out on this rank found missing (a store barrier knows who
    did not arrive even when no span marks it): they are culprits when the records name nobody.
    ``unreachable`` says why no peer record could be read: then only this rank's own position is known.
    """
    if unreachable is not None:
        own: dict[int, JsonDict | None] = {r: rec for r, rec in records.items() if rec is not None}
        return Diagnosis(cause, detail, origin, phase, {}, sorted(set(hint or [])), dict(dead or {}), own, {}, now,
                         unreachable)
    dead = dict(dead or {})
    live = {r: rec for r, rec in records.items() if rec is not None and r not in dead}
    waits = {}
    for r, rec in live.items():
        if rec.get("state") == "exited":
            continue
        w = _wait_of(r, rec, records, world)
        if w is not None:
            waits[r] = w
    waiting = {r for r, w in waits.items() if w.missing}
    named = set().union(*(set(w.missing) for w in waits.values())) if waits else set()
    top = max((int(rec.get("sync", 0)) for rec in live.values()), default=0)
    lagging = {r: int(rec.get("sync", 0)) for r, rec in live.items() if int(rec.get("sync", 0)) < top}
    # A rank that failed, died or diverged is the root cause; where the others wait is context. A rank that left
    # because its own watchdog reported a hang is a reporter, not a cause: the ranks the waits miss are.
    reporters = {r for r in dead if _left_reporting_a_hang(records.get(r))}
    if reporters and named - set(dead):
        dead_causes = set(dead) - reporters
    else:
        dead_causes = set(dead)
    known = dead_causes | (set(hint or []) if cause == "sequence" else set())
    if cause == "failed" and origin is not None:
        known.add(origin)
    if cause != "hang" and known:
        culprits = sorted(known)
    else:
        culprits = sorted((named | set(lagging) | dead_causes) - (waiting - set(dead)))
    if not culprits and hint:
        culprits = sorted(set(hint))
    culprits = _not_waiting(culprits, live, set(dead))
    return Diagnosis(cause, detail, origin, phase, waits, culprits, dead, dict(records), lagging, now)


def _not_waiting(culprits: list[int], live: dict[int, JsonDict], dead: set[int]) -> list[int]:
    """Of ranks no traced op tells apart (each in its step, say), the ones blocked in a collective wait for the
    others (a MoE all-to-all, a tensor-parallel all-reduce lifecycle does not trace): when some live culprit is
    blocked in its own code, only those are named (and the dead)."""
    own = [r for r in culprits if r in dead or (live.get(r) or {}).get("blocked") == "own code"]
    waiting = [r for r in culprits if r not in dead and (live.get(r) or {}).get("blocked") == "collective"]
    return sorted(r for r in culprits if r not in waiting) if own and waiting else culprits


def crossed(rank: int, op: Op, begun: dict[str, int], peers: dict[int, JsonDict | None],
            world: int) -> tuple[str, list[int]] | None:
    """A peer and ``rank`` each blocked in an op the other has not begun (a divergence), or None.

    ``op`` is the op ``rank`` is blocked in (name, group, seq, ranks); ``begun`` its per-group counts;
    ``peers`` the records of the members of ``op``'s group. With the same program on every rank this
    cannot happen, even with records a poll old: each side's record proves the other one is stuck.
    """
    for m, rec in sorted(peers.items()):
        if rec is None or rec.get("state") != "running" or not rec.get("op"):
            continue
        if int(rec.get("begun", {}).get(op.group, 0)) >= op.seq:
            continue  # m has reached my op: it is not what I wait for
        name, group, seq, _ = rec["op"]
        theirs = rec.get("ranks") or (list(range(world)) if group in ALL_RANKS else [])
        if rank in theirs and int(begun.get(group, 0)) < seq:
            low, high = sorted((rank, m))
            return (f"ranks {low} and {high} wait for each other: rank {rank} is in {op.name} on group {op.group} "
                    f"(op #{op.seq} there), which rank {m} has not begun; rank {m} is in {name} on group {group} "
                    f"(op #{seq} there), which rank {rank} has not begun. Their collective sequences diverge: "
                    f"one of them skipped or added a collective", sorted({rank, m}))
    return None


def where(rec: JsonDict | None, now: float) -> str:
    if rec is None:
        return "never reported (it died or hung before its watchdog started)"
    op = rec.get("op") or rec.get("last")
    at = "in" if rec.get("op") else "after"
    text = f"phase {rec.get('phase')}"
    if rec.get("step") is not None:
        text += f" step {rec['step']}"
    if op:
        text += f", {at} op {op[0]} on group {op[1]} (#{op[2]})"
    elif rec.get("from_events"):
        text += f", its last event: {rec['from_events']}"
    if rec.get("blocked"):
        text += ", blocked in a collective" if rec["blocked"] == "collective" else ", busy in its own code"
    if rec.get("state") not in (None, "running"):
        error = str(rec.get("error") or "")
        text += f", state {rec['state']}" + (f": {error[:160]}" + ("..." if len(error) > 160 else "") if error else "")
    idle = float(rec.get("idle_s", 0.0)) + max(now - float(rec.get("t", now)), 0.0)
    return text + f"; no progress for {idle:.1f}s"


def render(d: Diagnosis, rank: int, *, extra: list[str] | None = None) -> str:
    """The report printed on ``rank``: one header line, then what this rank waits for and who is stuck."""
    lines = [f"lifecycle watchdog: {CAUSES.get(d.cause, d.cause.upper())} in phase {d.phase}: {d.detail}"]
    if d.unreachable is not None:
        lines.append(f"  rank {rank} is at {where(d.records.get(rank), d.now)}")
        lines.append(f"  peers could not be asked: {d.unreachable} (a network partition, or the store's host died)")
        if d.culprits:
            lines.append(f"  the op that timed out here names ranks [{fmt_ranks(d.culprits)}] as missing")
        lines.extend(extra or [])
        return "\n".join(f"[rank {rank}] {line}" for line in lines)
    mine = d.waits.get(rank)
    if mine is not None:
        lines.append(f"  rank {rank} {mine.describe()}")
    top = max((int((rec or {}).get("sync", 0)) for rec in d.records.values()), default=0)
    for r in d.culprits:
        rec = d.records.get(r)
        state = f"DEAD ({d.dead[r]})" if r in d.dead else "alive" if (rec or {}).get("state", "running") == \
            "running" else str((rec or {})["state"])
        who = "this rank" if r == rank else f"rank {r}"
        behind = (f"; it passed {d.lagging[r]} store sync points (barriers, checkpoint keys), the others {top}"
                  if r in d.lagging else "")
        lines.append(f"  stuck: {who} [{state}]: {where(rec, d.now)}{behind}")
    if not d.culprits:
        lines.append("  no rank is behind by the progress records; positions: " + "; ".join(
            f"rank {r}: {w.op}/{w.group}#{w.seq}" for r, w in sorted(d.waits.items())[:16]))
    others = sorted(r for r, w in d.waits.items() if w.missing and r != rank)
    if others:
        lines.append("  also waiting: " + "; ".join(
            f"rank {r} in {d.waits[r].op} on {d.waits[r].group} for [{fmt_ranks(d.waits[r].missing, limit=8)}]"
            for r in others[:8]) + (f" (+{len(others) - 8} ranks)" if len(others) > 8 else ""))
    if d.dead:
        lines.append("  dead ranks: " + ", ".join(f"{r} ({how})" for r, how in sorted(d.dead.items())))
    lines.extend(extra or [])
    return "\n".join(f"[rank {rank}] {line}" for line in lines)
