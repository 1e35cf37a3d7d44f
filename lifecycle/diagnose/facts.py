"""What the readers found: facts about ranks, each with the file and line it came from, and the Flight Recorder
dumps in summary. The verdict (:mod:`lifecycle.diagnose.verdict`) is decided from these alone.

Group keys: a process group is named by its pg name (torch's GUID, the same string on every rank: ``"0"`` for the
default group, ``"3"`` ...) as Flight Recorder dumps and ProcessGroupNCCL's log prefix (``PG GUID 3(desc)``) give
it; :data:`DEFAULT` is the default group. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT = "0"
DEFAULT_DESC = "default_pg"

CRASH = "crash"
"""A rank raised an exception that is not the consequence of a peer (a timeout, a closed connection)."""
CONSEQUENCE = "consequence"
"""A rank failed because of a peer or the network: a timeout, a closed or reset connection, an aborted group."""
KILLED = "killed"
"""A rank died by a signal the launcher did not send (SIGKILL from outside, SIGSEGV ...)."""
TERMINATED = "terminated"
"""The launcher itself ended the rank (SIGTERM after another rank failed): never a cause."""
TIMEOUT = "timeout"
"""A watchdog timed out in op ``seq`` of ``group`` on this rank: it entered the op and it did not finish."""
PROGRESS = "progress"
"""The rank's own count of ops on ``group``: ``enq`` enqueued (entered), ``done`` completed."""
NAMED = "named"
"""PyTorch itself named ``ranks`` (group ranks of ``group``): desync report, monitored barrier, a store key."""
LINK = "link"
"""A network error naming both ends: this rank's ``host`` and ``peer``."""
STAGE = "stage"
"""A hint of where the job was (``stage``): a frame, a checkpoint line, an iteration line."""
REPORT = "report"
"""lifecycle's own hang report: ``ranks`` are its culprits, ``detail`` its cause, ``stage`` its phase."""


@dataclass
class Fact:
    """One thing a line (or a file) says; ``where`` is ``file:line``."""

    kind: str
    rank: int | None
    where: str
    group: str | None = None
    seq: int | None = None
    op: str | None = None
    detail: str = ""
    ranks: tuple[int, ...] = ()
    host: str | None = None
    peer: str | None = None
    enq: int | None = None
    done: int | None = None
    stage: str | None = None
    cause: str | None = None
    local: int | None = None
    """The rank's local rank when only that is known (resolved to ``rank`` at the end of its file's scope)."""


@dataclass
class DumpOp:
    """One collective in a Flight Recorder dump."""

    group: str
    seq: int
    op: str
    sizes: str
    record: int
    frames: str
    p2p: bool = False
    desc: str = ""
    state: str = ""
    """The recorder's state of the op: ``completed`` proves it finished (NCCL); gloo records every op as
    ``scheduled``, which proves only that the rank entered it."""
    peer: int | None = None
    """A point-to-point op's peer as a rank of its group, when the record names it (NCCL's ``send 0->1``)."""


@dataclass
class Dump:
    """The summary of one rank's Flight Recorder dump (the rank read from it, or how else it is known)."""

    rank: int
    where: str
    version: str
    rank_from: str
    ops: list[DumpOp] = field(default_factory=list)
    enq: dict[str, int] = field(default_factory=dict)
    descs: dict[str, str] = field(default_factory=dict)
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    world: int | None = None
    wrapped: bool = False
    """The recorder's ring buffer overwrote older entries: a group with no entry left is of unknown progress."""
    states: bool = False
    """The dump records completion (NCCL's ``completed`` state): a later record does not prove an op finished
    (NCCL ops are asynchronous), only its own state does. False for gloo, whose calls return when the op is done."""


@dataclass
class Evidence:
    """Everything read: facts, dumps, group names and members, counts of lines and files."""

    facts: list[Fact] = field(default_factory=list)
    dumps: dict[int, Dump] = field(default_factory=dict)
    present: dict[int, str] = field(default_factory=dict)
    """Ranks whose own log was read (rank -> the first file:line of it)."""
    descs: dict[str, str] = field(default_factory=lambda: {DEFAULT: DEFAULT_DESC})
    members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    world: int | None = None
    files: int = 0
    skipped_files: int = 0
    lines: int = 0
    used_lines: int = 0
    unattributed: int = 0
    notes: list[str] = field(default_factory=list)
    unusable: list[str] = field(default_factory=list)
    """Inputs skipped because they could not be used (each says why and what would make it usable)."""
    layout: dict[str, list[list[int]]] | None = None
    """The job's layout as the user gave it (``diagnose -w N -o ...``): dimension -> its groups' ranks; it proves a
    group's membership where the dumps do not record it (gloo)."""

    def add(self, fact: Fact) -> None:
        self.facts.append(fact)

    def of(self, kind: str) -> list[Fact]:
        return [f for f in self.facts if f.kind == kind]

    def see_world(self, size: int) -> None:
        if size > 0:
            self.world = max(self.world or 0, size)
