"""Read console logs, streaming: a chunk at a time, only the lines that can matter are decoded and parsed.

A search for a few literal words finds candidate lines in each chunk (:mod:`scan`); each candidate line is split from its
launcher prefixes (:mod:`prefixes`) and given to the parsers of :mod:`lines`. Python tracebacks are followed per
writer (the exception line that ends one is a crash, or a consequence of a peer), and torchrun's failure summary
per file. Lines no parser uses are counted, never kept. Facts about a local rank wait for the end of the reading,
when every scope (one torchrun) knows its offset. Pure Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lifecycle.diagnose import facts as F
from lifecycle.diagnose import files, lines, prefixes, scan
from lifecycle.diagnose.facts import Evidence, Fact

PEER_EXITS = frozenset({1, 3, 4, 5})
"""Exit statuses a rank also exits with when a peer failed: Python's uncaught exception (a timeout), lifecycle's hang,
rank-failed and teardown-deadline codes."""
LABEL_PRESENCE = re.compile(rb"(?m)^(\d{1,6}): ")


@dataclass
class _Writer:
    """A traceback in progress for one writer (a rank, or a local rank of a scope)."""

    frames: list[str] = field(default_factory=list)
    in_traceback: bool = False
    group: str | None = None


@dataclass
class Reader:
    """The state of reading every log: offsets per scope, pids the launcher signalled, facts still local."""

    ev: Evidence
    offsets: dict[str, set[int]] = field(default_factory=dict)
    pending: list[tuple[str, Fact]] = field(default_factory=list)
    local_presence: dict[str, dict[int, str]] = field(default_factory=dict)
    agent_pids: set[int] = field(default_factory=set)
    exits: list[tuple[str, Fact, int]] = field(default_factory=list)
    errfiles: dict[str, tuple[str, int | None, int | None]] = field(default_factory=dict)
    pid_rank: dict[int, int] = field(default_factory=dict)
    roots: list[tuple[int, int, str]] = field(default_factory=list)
    """torchrun's ``Root Cause (first observed failure)``: (global rank, exit code, file:line) where the code is an
    exit status (a signal is judged with the others)."""

    def judge_roots(self) -> None:
        """A rank torchrun saw fail first, with an exit status of its own, whose own lines show no failure caused
        by a peer (no timeout, no closed connection; a peer's failure makes Python exit 1 with a traceback, which
        torch prints ``[rankN]:``-prefixed): it crashed (``sys.exit(7)`` leaves no traceback). A status a victim
        exits with too (1, lifecycle's 3-5) needs the rank's own log read. Called once every input is read (an
        error file may say it was a consequence)."""
        for rank, code, where in self.roots:
            mine = [f for f in self.ev.facts if f.rank == rank]
            if any(f.kind in (F.CONSEQUENCE, F.TIMEOUT, F.CRASH) for f in mine):
                continue
            if rank not in self.ev.present and code in PEER_EXITS:
                continue  # its own lines are not told apart, and its status is one a victim exits with too
            self.ev.add(Fact(F.CRASH, rank, where, detail=f"exit code {code}: torchrun's first observed failure; "
                             f"its own log shows no failure caused by a peer"))

    def finish(self) -> None:
        """Resolve local ranks with each scope's offset (one consistent value, else they stay unknown), and
        judge torchrun's exit records against the signals its agent sent."""
        for scope, fact in self.pending:
            offset = self._offset(scope)
            if offset is None or fact.local is None:
                self.ev.unattributed += 1
                continue
            fact.rank = fact.local + offset
            self.ev.add(fact)
        for scope, seen in self.local_presence.items():
            offset = self._offset(scope)
            for local, where in seen.items():
                if offset is not None:
                    self.ev.present.setdefault(local + offset, where)
        for _, fact, pid in self.exits:
            sigterm = fact.detail.endswith(("SIGTERM", "(SIGTERM)", "(signal 15)"))  # torchrun's own closing signal
            fact.kind = F.TERMINATED if pid in self.agent_pids or sigterm else fact.kind
            self.ev.add(fact)

    def _offset(self, scope: str) -> int | None:
        found = self.offsets.get(scope, set())
        return next(iter(found)) if len(found) == 1 else None


def read(path_str: str, head: bytes, reader: Reader) -> None:
    """Read one log file into ``reader``."""
    from pathlib import Path

    path = Path(path_str)
    rank, local, scope = prefixes.of_path(path)
    state = _File(reader, path_str, scope, prefixes.labelled(head), rank, local)
    if rank is not None:
        reader.ev.present.setdefault(rank, f"{path_str}:1")
    elif local is not None:
        reader.local_presence.setdefault(scope, {}).setdefault(local, f"{path_str}:1")
    for chunk in files.chunks(path):
        state.chunk(chunk)
    if state.iteration is not None:  # the last iteration line the file holds: the step the job reached
        state.line(state.iteration[2], state.iteration[1])
    reader.ev.lines += state.lineno


class _File:
    """One file being read: line numbers, the writers' tracebacks, torchrun's summary block."""

    def __init__(self, reader: Reader, name: str, scope: str, labelled: bool, rank: int | None,
                 local: int | None) -> None:
        self.r, self.name, self.scope, self.labelled = reader, name, scope, labelled
        self.rank, self.local = rank, local
        self.lineno = 0
        self.writers: dict[tuple[int | None, int | None], _Writer] = {}
        self.block: dict[str, str] = {}
        self.root = False
        """Within torchrun's ``Root Cause (first observed failure)`` block."""
        self.iteration: tuple[int, int, str] | None = None
        """(iteration, line number, line) of the last ``iteration N/ M`` line read."""

    def chunk(self, data: bytes) -> None:
        if self.rank is None and self.local is None:
            self._presence(data)
        found = scan.last_iteration(data)
        if found is not None and (self.iteration is None or found[1] >= self.iteration[0]):
            start, it = found
            end = data.find(b"\n", start)
            text = data[start:end if end >= 0 else len(data)].decode("utf-8", "replace")
            self.iteration = (it, self.lineno + data.count(b"\n", 0, start) + 1, text)
        pos = 0
        for start in scan.candidates(data):
            end = data.find(b"\n", start)
            self.lineno += data.count(b"\n", pos, start)
            pos = start
            self.line(data[start:end if end >= 0 else len(data)].decode("utf-8", "replace"), self.lineno + 1)
        self.lineno += data.count(b"\n", pos)
        if data and not data.endswith(b"\n"):
            self.lineno += 1

    def _presence(self, data: bytes) -> None:
        seen = prefixes.presence(data, is_labelled=self.labelled)
        if self.labelled:
            seen |= {(int(t), None) for t in set(LABEL_PRESENCE.findall(data))}
        for rank, local in seen:
            if rank is not None:
                self.r.ev.present.setdefault(rank, f"{self.name}:{self.lineno + 1}")
            elif local is not None:
                self.r.local_presence.setdefault(self.scope, {}).setdefault(local, f"{self.name}:{self.lineno + 1}")

    def line(self, raw: str, lineno: int) -> None:
        who = prefixes.split(raw.rstrip("\r"), labelled=self.labelled)
        rank = who.rank if who.rank is not None else self.rank
        local = who.local if who.local is not None else self.local
        if rank is not None and local is not None:
            self.r.offsets.setdefault(self.scope, set()).add(rank - local)
        if who.pid is not None and rank is not None:
            self.r.pid_rank[who.pid] = rank
        elif who.pid is not None and rank is None:
            rank = self.r.pid_rank.get(who.pid)
        text = who.text
        pg = lines.PG_PREFIX.search(text)
        if rank is None and pg and pg.group("desc") == F.DEFAULT_DESC:
            rank = int(pg.group("grank"))
        where = f"{self.name}:{lineno}"
        before = len(self.r.ev.facts) + len(self.r.pending)
        _parse(self, text, _Ctx(rank, local, where, pg, self._writer(rank, local)), who.host)
        if len(self.r.ev.facts) + len(self.r.pending) > before or self.block:
            self.r.ev.used_lines += 1

    def _root(self, text: str) -> bool:
        if lines.ROOT_CAUSE.search(text):
            self.root = True
            return True
        return False

    def _writer(self, rank: int | None, local: int | None) -> _Writer:
        return self.writers.setdefault((rank, local if rank is None else None), _Writer())

    def emit(self, ctx: _Ctx, kind: str, **fields: object) -> None:
        fact = Fact(kind, ctx.rank, ctx.where, local=ctx.local, **fields)  # type: ignore[arg-type]
        if fact.rank is None and kind not in (F.NAMED, F.LINK, F.STAGE):
            if fact.local is not None:  # made global at the end, with the scope's offset
                self.r.pending.append((self.scope, fact))
            return  # no rank at all: the launcher's own lines (its ChildFailedError)
        self.r.ev.add(fact)


@dataclass
class _Ctx:
    rank: int | None
    local: int | None
    where: str
    pg: re.Match[str] | None
    writer: _Writer


def _group(f: _File, ctx: _Ctx) -> str | None:
    if ctx.pg is None:
        return ctx.writer.group
    guid, desc = ctx.pg.group("guid"), ctx.pg.group("desc") or ""
    if desc:
        f.r.ev.descs.setdefault(guid, desc)
    ctx.writer.group = guid
    return guid


def _parse(f: _File, text: str, ctx: _Ctx, host: str | None) -> None:
    if host and ctx.rank is not None:
        f.r.ev.hosts.setdefault(ctx.rank, host)
    for parser in (_reports, _traceback, _nccl, _summary, _misc):
        if parser(f, text, ctx):
            return


def _traceback(f: _File, text: str, ctx: _Ctx) -> bool:
    w = ctx.writer
    if lines.TRACEBACK in text:
        w.in_traceback, w.frames = True, []
        return True
    m = lines.FRAME.match(text)
    if m:
        w.frames.append(f"{m.group('func') or m.group('func2')} {m.group('file') or m.group('file2')}")
        return True
    m = lines.EXCEPTION.match(text.strip())
    if m and w.in_traceback:
        _exception(f, ctx, f"{m.group('type')}: {m.group('msg') or ''}".strip(), w.frames)
        w.in_traceback = False
        return True
    m = lines.WHAT.match(text)
    if m:
        _exception(f, ctx, m.group("msg"), w.frames)
        return True
    return False


def _exception(f: _File, ctx: _Ctx, message: str, frames: list[str]) -> None:
    kind = F.CONSEQUENCE if lines.is_consequence(message) else F.CRASH
    stage = next((s for fr in reversed(frames) if (s := lines.stage_of(fr.split(" ")[0]))), None)
    stage = stage or next((s for fr in reversed(frames) if (s := lines.stage_of(fr))), None)
    f.emit(ctx, kind, detail=message[:500], stage=stage, op=_op_of(frames))


P2P_FRAMES = ("p2p_communication", "batch_isend_irecv", "_batched_p2p_ops", "_p2p_ops", "isend", "irecv")
"""Frames of point-to-point calls: torch's, and Megatron's pipeline (whose batched sends and receives fail in a
``wait()`` below them)."""


def _op_of(frames: list[str]) -> str | None:
    ops = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "all_to_all", "send", "recv",
           "gather", "scatter", "reduce", "monitored_barrier")
    if any(marker in frame for frame in frames[-6:] for marker in P2P_FRAMES):
        return "p2p"
    for frame in reversed(frames):
        name = frame.split(" ")[0]
        if name in ops or name.removesuffix("_into_tensor").removesuffix("_base") in ops:
            return name
    return None


def _nccl(f: _File, text: str, ctx: _Ctx) -> bool:
    m = lines.WORK_TIMEOUT.search(text)
    if m:
        f.emit(ctx, F.TIMEOUT, group=_group(f, ctx), seq=int(m.group("seq")), op=m.group("op").lower())
        return True
    for pattern in lines.PG_STATUS:
        m = pattern.search(text)
        if m:
            f.emit(ctx, F.PROGRESS, group=_group(f, ctx), seq=int(m.group("seq")), enq=int(m.group("enq")),
                   done=int(m.group("done")))
            return True
    m = lines.LAST_WORK.search(text)
    if m:
        f.emit(ctx, F.PROGRESS, group=_group(f, ctx), enq=int(m.group("enq")), done=int(m.group("done")))
        return True
    _group(f, ctx)
    return False


def _reports(f: _File, text: str, ctx: _Ctx) -> bool:
    causes = ("never entered", "entered, not finished", "never entered")
    for pattern, cause in zip(lines.DESYNC, causes, strict=True):
        m = pattern.search(text)
        if m:
            seq = int(m.group("seq")) if "seq" in pattern.groupindex else None
            f.emit(ctx, F.NAMED, group=ctx.writer.group, ranks=lines.ranks_of(m.group("ranks")), seq=seq,
                   cause=cause, detail="PyTorch's desync report")
            return True
    m = lines.MONITORED.search(text)
    if m:
        f.emit(ctx, F.NAMED, group=F.DEFAULT, ranks=lines.ranks_of(m.group("ranks")), cause="never entered",
               detail="monitored_barrier on the default group")
        return True
    m = lines.STORE_KEYS.search(text)
    if m and (named := lines.store_key_rank(m.group("keys"))) is not None:
        f.emit(ctx, F.NAMED, group=F.DEFAULT, ranks=(named,), cause="rendezvous", stage="init",
               detail=f"the ranks waited for rank {named}'s address in the store (key {m.group('keys')[:120]}): "
                      f"it never reached init_process_group")
    return False  # the line is also an exception (DistStoreError): the traceback parser takes it too


def _summary(f: _File, text: str, ctx: _Ctx) -> bool:
    for key, pattern in (("rank", lines.SUMMARY_RANK), ("host", lines.SUMMARY_HOST)):
        m = pattern.match(text)
        if m:
            f.block = {**({} if key == "rank" else f.block), **m.groupdict(), **({"host": f.block.get("host", "")}
                                                                                 if key == "rank" else {})}
            if key == "rank":
                f.r.offsets.setdefault(f.scope, set()).add(int(m.group("rank")) - int(m.group("local")))
            return True
    if f._root(text):
        return True
    m = lines.SUMMARY_EXIT.match(text)
    if m and "rank" in f.block:
        _exit(f, ctx, m)
        return True
    m = lines.SUMMARY_ERRFILE.match(text)
    if m and "rank" in f.block:
        f.r.errfiles[m.group("path")] = (f.block.get("host", ""), int(f.block["rank"]), int(f.block["local"]))
        return True
    m = lines.AGENT_SIGNAL.search(text)
    if m:
        f.r.agent_pids.add(int(m.group("pid")))
        return True
    return False


def _exit(f: _File, ctx: _Ctx, m: re.Match[str]) -> None:
    code, rank = int(m.group("code")), int(f.block["rank"])
    if f.block.get("host"):
        f.r.ev.hosts.setdefault(rank, f.block["host"])
    if code > 0 and f.root and code not in (128 + 6, 128 + 9, 128 + 15):  # not a signal's status
        f.r.roots.append((rank, code, ctx.where))
    if code >= 0:
        return
    sig = m.group("sig") or f"signal {-code}"
    fact = Fact(F.KILLED, rank, ctx.where, detail=f"exit code {code} ({sig})")
    f.r.exits.append((f.scope, fact, int(m.group("pid"))))


def _misc(f: _File, text: str, ctx: _Ctx) -> bool:
    m = lines.CLIENTS.search(text)
    if m:
        f.r.ev.see_world(int(m.group("world")))
        return True
    link = lines.nccl_link(text)
    if link is not None:
        f.emit(ctx, F.LINK, host=link[0], peer=link[1], detail=text.strip()[:300])
        return True
    m = lines.ITERATION.search(text)
    if m:
        f.emit(ctx, F.STAGE, stage="train", seq=int(m.group("it")), detail=text.strip()[:200])
        return True
    return False
