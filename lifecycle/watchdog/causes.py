"""Why the watchdog reports: the :class:`Cause` of a report and the checks that find one.

Each check is cheap and local or O(1) on the store: a phase deadline (no store call), the alarm key
(one ``check``), the launcher's shutdown marker (one ``stat``), the heartbeat of two peers (two
``add(key, 0)``), and, only while this rank sits in one op, a look at that op's small group for two
ranks that wait for each other (a collective-sequence divergence). :func:`classify` sorts the errors
that reach the failure path.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

from lifecycle.errors import (
    HangError,
    LifecycleError,
    PolicyError,
    RestartRequested,
    SequenceMismatch,
    Shutdown,
    UsageError,
)
from lifecycle.jsontypes import Json, JsonDict
from lifecycle.rundir import read_marker
from lifecycle.watchdog import diagnosis
from lifecycle.watchdog.seqcheck import PROBE_MAX_GROUP
from lifecycle.watchdog.sidechannel import SideChannel
from lifecycle.watchdog.tracker import ProgressTracker

_PEER_SIGNS = ("Connection closed by peer", "Connection reset", "Broken pipe", "communicator was aborted")


class Cause(NamedTuple):
    """Why a report is due: kind (hang|dead|unresponsive|failed|sequence|lost|usage), one line, the rank it started on, its phase,
    ranks known dead (rank -> how) and ranks the detector names (``hint``)."""

    kind: str
    detail: str
    origin: int | None
    phase: str | None
    dead: dict[int, str] = {}
    hint: list[int] = []
    t: float | None = None
    """When the failure became known (the alarm's or the launcher's marker's time), where one says."""

    @property
    def urgent(self) -> bool:
        """Act at once: a hang, a divergence or a silent peer never resolves (a frozen process cannot leave by
        itself); a failed or dead peer gets a grace to leave first, so the launcher names it."""
        return self.kind in ("hang", "sequence", "lost", "unresponsive")

    def alarm(self, rank: int) -> JsonDict:
        """The JSON this rank sets as the alarm."""
        return {"rank": rank, "cause": self.kind, "detail": self.detail, "phase": self.phase,
                "dead": {str(r): how for r, how in self.dead.items()}, "hint": self.hint, "t": time.time()}


def deadline_passed(tracker: ProgressTracker, deadline_s: float, rank: int, *, bound: str | None = None,
                    how: str | None = None) -> Cause | None:
    """No begin/end on this rank for the deadline that bounds it (``bound``: its phase's, or its span's own: a
    trainer's ``setup``/``eval``, a resume's ``checkpoint``). No store call. ``how`` says how an adaptive deadline
    was derived."""
    phase, idle = tracker.phase, tracker.idle_s()
    if idle < deadline_s:
        return None
    op = tracker.current()
    where = f" (at {op.name} on group {op.group}, op #{op.seq} there)" if op else ""
    rule = f" ({how})" if how else ""
    return Cause("hang", f"rank {rank} made no progress for {idle:.1f}s{where}; the {bound or phase} deadline is "
                 f"{deadline_s:.3g}s{rule}", rank, phase)


def from_alarm(ch: SideChannel, rank: int) -> Cause | None:
    """Another rank's alarm, if one stands."""
    info = ch.alarm()
    if info is None or info.get("rank") == rank:
        return None
    dead = {int(r): how for r, how in (info.get("dead") or {}).items()}
    return Cause(info["cause"], info["detail"], info.get("rank"), info.get("phase"), dead,
                 [int(r) for r in info.get("hint") or []], _time(info.get("t")))


def from_marker(run_dir: Path) -> Cause | None:
    """The local launcher's shutdown marker: which rank ended, how, in which phase."""
    info: Json = read_marker(run_dir)
    if info is None:
        return None
    rank, how = info.get("rank"), info.get("how") or "ended"
    if rank is None:
        return Cause("dead", f"the launcher is stopping the job: {info.get('reason', '?')}", None, None)
    return Cause("dead", f"rank {rank} ended ({how}); the launcher is stopping the job", int(rank),
                 info.get("phase"), {int(rank): how}, t=_time(info.get("t")))


def _time(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class Heartbeats:
    """Watches the heartbeat counters of the ring neighbour and of rank 0 (two store calls per poll)."""

    def __init__(self, rank: int, world: int, stale_s: float) -> None:
        self.peers = sorted({(rank + 1) % world, 0} - {rank})
        self.stale_s = stale_s
        self._seen: dict[int, tuple[int, float]] = {}

    def check(self, ch: SideChannel) -> Cause | None:
        now = time.monotonic()
        for peer in self.peers:
            count = ch.beats(peer)
            seen = self._seen.get(peer)
            if count == 0 or seen is None or seen[0] != count:  # not started yet, or alive
                self._seen[peer] = (count, now)
                continue
            if now - seen[1] <= self.stale_s:
                continue
            rec = ch.record(peer)
            if rec is not None and rec.get("state") != "running":
                self._seen[peer] = (count, float("inf"))  # it left (exited or failed): not dead
                continue
            how = f"no heartbeat for {now - seen[1]:.1f}s"
            return Cause("unresponsive", f"rank {peer} stopped sending heartbeats ({how}): frozen, cut off or dead",
                         peer,
                         (rec or {}).get("phase"), {peer: how})
        return None


def crossed_wait(tracker: ProgressTracker, ch: SideChannel, rank: int, world: int) -> Cause | None:
    """This rank and a member of its op's group each blocked in an op the other has not begun.

    Reads the records of that group (at most ``PROBE_MAX_GROUP`` ranks); the caller rate-limits it.
    """
    op = tracker.waiting_in()
    if op is None:
        return None
    members = op.ranks or (list(range(world)) if op.group in diagnosis.ALL_RANKS else [])
    if not members or len(members) > PROBE_MAX_GROUP:
        return None
    found = diagnosis.crossed(rank, op, tracker.record()["begun"], ch.records([m for m in members if m != rank]),
                              world)
    return Cause("sequence", found[0], rank, tracker.phase, {}, found[1]) if found else None


def classify(exc: BaseException) -> str:
    """hang | peer (a peer's connection broke) | shutdown (the launcher stops the job) | sequence | usage (a bad
    policy, environment or checkpoint: exit 2, not a hang) | lost (the store's connection broke) | failed."""
    if isinstance(exc, PolicyError | UsageError):
        return "usage"
    if isinstance(exc, HangError):
        return "hang"
    if isinstance(exc, SequenceMismatch):
        return "sequence"
    if isinstance(exc, Shutdown):
        return "shutdown"
    if isinstance(exc, RestartRequested):
        return "peer"  # a peer failed and asked for a restart in place
    from torch.distributed import DistNetworkError, DistStoreError  # a rank's failure path: torch is loaded

    if isinstance(exc, DistNetworkError) or isinstance(exc.__cause__, DistNetworkError):
        return "lost"  # the store's connection broke: its host died, or the network to it did
    text = f"{exc} {exc.__cause__ or ''}"
    if any(sign in text for sign in _PEER_SIGNS):
        return "peer"
    if not isinstance(exc, LifecycleError) and ("timed out" in text.lower() or isinstance(exc, DistStoreError)):
        return "hang"
    return "failed"
