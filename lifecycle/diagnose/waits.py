"""Who waits for whom, from what each rank's own evidence proves.

A rank's position on a group is the highest collective sequence number it entered there (``enq``): from its Flight
Recorder dump, or from ProcessGroupNCCL's ``last enqueued work`` lines. A record proves that the rank *entered* an
op, never that it *left* it: gloo records every op as ``scheduled``. An op is proven finished only by its recorded
``completed`` state (NCCL), or, on gloo, whose collective calls return when the op is done, by a later record of the
same rank. (The one assumption: a gloo collective was issued synchronously; one issued with ``async_op=True`` and
waited for later would be taken as left by the records that follow it.) A rank waits *for* the members of a group whose own position there is known and below the op it has
not finished: they never entered it.

A rank is *free* when every op it entered can finish: each is recorded completed, left by a later gloo record, or
entered by every member of its group, with that membership proven (the dump's ``pg_config``, lifecycle's hang
report, the default group of a known world, or every rank's complete dump where an op of the group is proven
finished). Point-to-point ops finish when the peer entered the matching op (the k-th send to a peer matches the
peer's k-th receive from the rank), the peer known from the record (NCCL's ``send 0->1``) or a proven group of two.
Anything else leaves the rank *unresolved* (:attr:`Graph.unresolved`): it may wait for a member nobody heard from.

Only a free rank that others wait for is a root (:attr:`Graph.roots`): every rank that waits for it waits for a
rank that stopped issuing collectives. Ranks that wait for each other form a cycle: their orders of collectives
differ (a skipped op, another group first). Which of them departed is not proven by a vote over their programs
(ranks in other groups or stages run other programs, and a history shared so far does not make two programs the
same), so a cycle names suspects, not culprits. Ops with the same sequence number on one group but a different name
or size on a strict minority of its members are a mismatch (:func:`mismatches`). Pure Python.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lifecycle.diagnose import facts as F
from lifecycle.diagnose.facts import Evidence
from lifecycle.diagnose.prevent import dimension


@dataclass
class Wait:
    rank: int
    group: str
    seq: int
    op: str | None
    where: str
    frames: str = ""
    missing: list[int] = field(default_factory=list)
    record: int | None = None
    """The op's record id in the waiting rank's dump (its place in that rank's program), None from a log."""


@dataclass
class Graph:
    waits: dict[int, Wait]
    enq: dict[int, dict[str, int]]
    members: dict[str, list[int]]
    free: set[int] = field(default_factory=set)
    """Ranks proven to wait for nobody (module docstring)."""
    unresolved: dict[int, list[str]] = field(default_factory=dict)
    """rank -> the groups where it entered an op that nothing proves can finish (membership or a member's
    progress unknown)."""
    proven: dict[str, list[int]] = field(default_factory=dict)
    """group -> its members, where the evidence proves the whole membership."""
    finished: dict[str, int] = field(default_factory=dict)
    """group -> the highest op some rank is proven to have left there (:func:`finished`)."""
    known: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """group -> (position, member) of the members whose position there is known, lowest first."""
    p2p: dict[int, Counter[tuple[str, int, bool]]] = field(default_factory=dict)
    """rank -> its sends and receives by (group, peer, is a send), counted once."""
    hidden: dict[int, str] = field(default_factory=dict)
    """rank -> why its gloo dump, which shows it left every collective it entered, does not prove it free (it may
    wait in a send or receive, which gloo does not record)."""
    recorded: set[str] = field(default_factory=set)
    """Groups whose members are recorded in group-rank order (``pg_config``, a hang report, the default group)."""

    @property
    def blocked(self) -> set[int]:
        return {r for r, w in self.waits.items() if w.missing}

    @property
    def named(self) -> set[int]:
        return {m for w in self.waits.values() for m in w.missing}

    @property
    def roots(self) -> list[int]:
        return sorted(r for r in self.named if r in self.free)

    def first_wait(self, culprits: list[int]) -> Wait | None:
        """The wait that shows the first op of the culprits' own program order they never entered.

        Of the waits for a culprit, those that wait for culprits only come first: a wait that also names a rank
        which itself waits is downstream of that rank's wait (rank 1 waits for rank 4 in dp; rank 0 waits for 1 and
        4 in the loss all-reduce that comes after dp). Then the op that comes earliest in the waiting rank's
        program (record ids count the ops every rank runs in the same order), then the lowest waiting rank.
        """
        edges = [w for w in self.waits.values() if set(w.missing) & set(culprits)]
        if not edges:
            return None
        blocked = self.blocked

        def order(w: Wait) -> tuple[bool, bool, int, int]:
            return bool(set(w.missing) & blocked), w.record is None, w.record or 0, w.rank

        return min(edges, key=order)

    def cycle(self) -> list[int]:
        """Ranks that wait, directly or not, for themselves."""
        out = []
        for start in sorted(self.blocked):
            seen, todo = set(), list(self.waits[start].missing)
            while todo:
                r = todo.pop()
                if r == start:
                    out.append(start)
                    break
                if r not in seen and r in self.waits:
                    seen.add(r)
                    todo.extend(self.waits[r].missing)
        return out


def positions(ev: Evidence) -> dict[int, dict[str, int]]:
    """rank -> group -> the highest sequence number the rank entered there (its own evidence only)."""
    enq: dict[int, dict[str, int]] = {}
    for rank, dump in ev.dumps.items():
        enq[rank] = dict(dump.enq)
    for fact in ev.facts:
        if fact.kind == F.PROGRESS and fact.rank is not None and fact.group and fact.enq is not None:
            mine = enq.setdefault(fact.rank, {})
            mine[fact.group] = max(mine.get(fact.group, 0), fact.enq)
    return enq


def members(ev: Evidence, enq: dict[int, dict[str, int]]) -> dict[str, list[int]]:
    """group -> its members: as recorded (pg_config), else the ranks seen using it; the default group: every rank."""
    out: dict[str, set[int]] = {}
    for rank, groups in enq.items():
        for g in groups:
            out.setdefault(g, set()).add(rank)
    for g, ranks in ev.members.items():
        out[g] = set(ranks)
    everyone = set(range(ev.world)) if ev.world else set(enq) | set(ev.present)
    out[F.DEFAULT] = out.get(F.DEFAULT, set()) | everyone
    return {g: sorted(r) for g, r in out.items()}


def finished(ev: Evidence) -> dict[str, int]:
    """group -> the highest sequence number some rank is proven to have left there (recorded ``completed``, or on
    gloo a later record of the same rank): every member entered that op, and all before it."""
    out: dict[str, int] = {}
    for dump in ev.dumps.values():
        last = dump.ops[-1].record if dump.ops else None
        for op in dump.ops:
            if not op.p2p and (op.state == "completed" if dump.states else op.record != last):
                out[op.group] = max(out.get(op.group, 0), op.seq)
    return out


def proven_members(ev: Evidence, seen: dict[str, list[int]], done: dict[str, int]) -> dict[str, list[int]]:
    """group -> members, where the whole membership is proven: recorded (``pg_config``, a hang report), the default
    group of a known world, or — every rank of the world dumped — the ranks seen on a group one of whose ops is
    proven finished (then every member entered it, and a complete dump of a member shows it)."""
    out = {g: list(r) for g, r in ev.members.items()}
    if ev.world:
        out[F.DEFAULT] = list(range(ev.world))
    for g, ranks in seen.items():
        if g not in out and (mine := _from_layout(ev, g, ranks)) is not None:
            out[g] = mine
    if not ev.world or any(r not in ev.dumps for r in range(ev.world)):
        return out
    for g in set(done) - set(out):
        ranks = seen.get(g, [])
        if all(not ev.dumps[r].wrapped for r in range(ev.world) if r not in ranks):
            out[g] = ranks
    return out


def _from_layout(ev: Evidence, group: str, ranks: list[int]) -> list[int] | None:
    """The group's members from the layout the user gave: the one group of its dimension that holds every rank
    seen on it (None when the layout, the dimension or that group is not known)."""
    if not ev.layout or not ranks:
        return None
    dim = dimension(ev.descs.get(group), None, None)
    holding = [m for m in ev.layout.get(dim or "", []) if set(ranks) <= set(m)]
    return sorted(holding[0]) if len(holding) == 1 else None


def _known(ev: Evidence, rank: int, group: str, enq: dict[int, dict[str, int]], proven: list[int] | None
           ) -> int | None:
    mine = enq.get(rank)
    if mine is None:
        return None
    if group in mine:
        return mine[group]
    dump = ev.dumps.get(rank)
    if dump is not None and not dump.wrapped and proven is not None and rank in proven:
        return 0  # a complete dump of a member with no op on the group: it never entered one
    return None


def graph(ev: Evidence) -> Graph:
    enq = positions(ev)
    seen = members(ev, enq)
    done = finished(ev)
    proven = proven_members(ev, seen, done)
    recorded = set(ev.members) | ({F.DEFAULT} if ev.world else set())
    g = Graph({}, enq, seen, proven=proven, recorded=recorded, finished=done)
    for rank, dump in sorted(ev.dumps.items()):
        _judge_dump(ev, g, rank, dump)
    for rank in sorted({f.rank for f in ev.facts if f.rank is not None} - set(ev.dumps)):
        _judge_log(ev, g, rank)
    hidden = unrecorded_p2p(ev)
    if hidden:
        for rank in sorted(r for r in g.free if r in ev.dumps and not ev.dumps[r].states):
            g.free.discard(rank)
            g.hidden[rank] = hidden
    return g


P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "recv_any_source", "p2p"})


def unrecorded_p2p(ev: Evidence) -> str | None:
    """Why a gloo dump cannot prove that a rank waits in no send or receive, or None when the evidence rules such
    waits out. gloo's Flight Recorder records collectives only (torch 2.9 ... 2.13): a rank past every collective
    it entered may be blocked in a send to a stalled peer, and no log line proves otherwise (a rank SIGTERMed
    before its own timeout prints nothing). The job's layout, given with ``-w``/``-o``, says whether it has a
    pipeline; a job without one is taken to send and receive nothing."""
    if ev.layout is None:
        return "gloo records no send or receive, and no layout (-w/-o) says the job has none"
    if any(len(m) > 1 for m in ev.layout.get("pp", [])):
        return "the layout given has a pipeline, whose sends and receives gloo does not record"
    return None


def _behind(ev: Evidence, g: Graph, rank: int, group: str, seq: int) -> list[int]:
    """Members of ``group`` whose own position there is known and below ``seq``."""
    known = g.known.get(group)
    if known is None:  # each member's known position on the group, lowest first (computed once per group)
        ranks = sorted(set(g.members.get(group, [])) | set(g.proven.get(group, [])))
        mem = g.proven.get(group)
        known = sorted((k, m) for m in ranks if (k := _known(ev, m, group, g.enq, mem)) is not None)
        g.known[group] = known
    out = []
    for k, m in known:
        if k >= seq:
            break
        if m != rank:
            out.append(m)
    return sorted(out)


def _left(g: Graph, group: str, seq: int, rank: int) -> bool:
    """Whether op ``seq`` of ``group`` is proven finished: some rank left it or a later one there. Every member
    having entered it proves nothing more: all in and none out is a hang inside the op."""
    return g.finished.get(group, 0) >= seq or g.proven.get(group) == [rank]  # a group of one waits for nobody


def _judge_dump(ev: Evidence, g: Graph, rank: int, dump: F.Dump) -> None:
    last_on: dict[str, F.DumpOp] = {}
    for op in dump.ops:
        if not op.p2p:
            last_on[op.group] = op
    final = dump.ops[-1].record if dump.ops else None
    waiting: list[tuple[F.DumpOp, list[int]]] = []
    unknown: list[str] = []
    for group, op in last_on.items():
        left = op.state == "completed" if dump.states else op.record != final
        behind = _behind(ev, g, rank, group, op.seq)
        if behind:
            (unknown.append(group) if left else waiting.append((op, behind)))  # left: the evidence disagrees
        elif not left and not _left(g, group, op.seq, rank):
            unknown.append(group)
    for op, peer in _open_p2p(ev, g, rank, dump):
        if peer is None:
            unknown.append(op.group)
        else:
            waiting.append((op, [peer]))
    if waiting:
        op, _ = min(waiting, key=lambda pair: pair[0].record)
        missing = sorted({m for _, b in waiting for m in b})
        g.waits[rank] = Wait(rank, op.group, op.seq, op.op, dump.where, op.frames, missing, record=op.record)
    elif dump.ops:
        op = dump.ops[-1]
        g.waits[rank] = Wait(rank, op.group, op.seq, op.op, dump.where, op.frames, record=op.record)
    if unknown:
        g.unresolved[rank] = sorted(set(unknown))
    elif not waiting:
        g.free.add(rank)


def _open_p2p(ev: Evidence, g: Graph, rank: int, dump: F.Dump) -> list[tuple[F.DumpOp, int | None]]:
    """The rank's point-to-point ops not proven finished, each with the peer that never entered the matching op
    (None: the peer or its progress is not known, or it entered the matching op and neither is recorded finished).
    The k-th send to a peer matches the peer's k-th receive."""
    out: list[tuple[F.DumpOp, int | None]] = []
    # gloo records no send or receive (:func:`unrecorded_p2p`); where a dump has them, a collective call that
    # returned after a batch of them proves the rank left the batch (it waits for its sends and receives together)
    past = -1 if dump.states else max((op.record for op in dump.ops if not op.p2p), default=-1)
    last: dict[tuple[str, int, bool], F.DumpOp] = {}
    for op in dump.ops:
        if not op.p2p or op.record < past or (dump.states and op.state == "completed"):
            continue
        peer = _peer_of(g, rank, op)
        if peer is None:
            out.append((op, None))
        else:
            last[(op.group, peer, "send" in op.op)] = op
    for (group, peer, is_send), op in last.items():
        other = ev.dumps.get(peer)
        if other is None or other.wrapped or dump.wrapped:
            out.append((op, None))
            continue
        mine = _p2p_counts(g, rank, dump).get((group, peer, is_send), 0)
        theirs = _p2p_counts(g, peer, other).get((group, rank, not is_send), 0)
        # the peer entered the matching op too, and nothing says it finished: both in, none out
        out.append((op, peer if theirs < mine else None))
    return out


def _peer_of(g: Graph, rank: int, op: F.DumpOp) -> int | None:
    mem = g.proven.get(op.group) if op.group in g.recorded else None
    if mem is None:
        return None
    if op.peer is not None:
        return mem[op.peer] if op.peer < len(mem) else None
    others = [m for m in mem if m != rank]
    return others[0] if len(mem) == 2 and len(others) == 1 else None


def _p2p_counts(g: Graph, rank: int, dump: F.Dump) -> Counter[tuple[str, int, bool]]:
    """(group, peer, is a send) -> how many such ops the rank's dump holds (counted once per rank)."""
    found = g.p2p.get(rank)
    if found is None:
        found = Counter()
        for op in dump.ops:
            if op.p2p and (peer := _peer_of(g, rank, op)) is not None:
                found[(op.group, peer, "send" in op.op)] += 1
        g.p2p[rank] = found
    return found


def _judge_log(ev: Evidence, g: Graph, rank: int) -> None:
    """A rank known from log lines only: it waits where its watchdog timed out or its count of completed ops is
    behind its count of entered ones. It is never proven free: a line speaks of one group (the heartbeat monitor's of
    the default group), and the rank may wait in another whose watchdog had not fired yet when the job ended."""
    mine = [f for f in ev.facts if f.rank == rank]
    wait: Wait | None = None
    for fact in mine:
        if fact.group is None:
            continue
        if fact.kind in (F.PROGRESS, F.TIMEOUT) and fact.seq is not None:
            wait = Wait(rank, fact.group, fact.seq, fact.op, fact.where)
        elif (fact.kind == F.PROGRESS and fact.enq is not None and fact.done is not None and fact.done < fact.enq
              and wait is None):
            wait = Wait(rank, fact.group, fact.done + 1, None, fact.where)
    if wait is None:
        return
    p2p = (wait.op or "").lower() in ("send", "recv", "recvanysource")  # its SeqNum counts point-to-point ops
    wait.missing = [] if p2p else _behind(ev, g, rank, wait.group, wait.seq)
    g.waits[rank] = wait
    if not wait.missing:
        g.unresolved[rank] = [wait.group]


MAX_COMPARED = 128
"""At most this many ranks of a cycle are compared pairwise (their programs, on the groups each pair shares)."""
COMPARE_BUDGET = 20_000_000
"""At most this many op comparisons (a few seconds): fewer ranks are compared when their dumps are long."""


def departed(ev: Evidence, ranks: list[int]) -> int | None:
    """The one rank whose order of collectives conflicts with two or more of ``ranks`` while no two others conflict
    with each other, or None.

    Any two ranks of a correct job run the collectives of the groups they share in the same order (else they would
    deadlock each other): their programs projected onto their shared groups are equal. Two ranks whose projections
    differ at some position conflict, and one of them departed from the job's order. When every conflict among the
    compared ranks involves one rank, and it conflicts with at least two (two that agree with each other), that rank
    is the single explanation of every conflict. Complete dumps only (a wrapped ring buffer loses the alignment)."""
    ranks = [r for r in ranks if r in ev.dumps][:MAX_COMPARED]
    if len(ranks) < 3 or any(ev.dumps[r].wrapped for r in ranks):
        return None
    progs = {r: [(o.group, o.op) for o in ev.dumps[r].ops if not o.p2p] for r in ranks}
    longest = max(len(p) for p in progs.values()) or 1
    fits = int((2 * COMPARE_BUDGET / longest) ** 0.5)  # n ranks cost n^2/2 comparisons of at most `longest` ops
    if fits < len(ranks):
        if fits < 3:
            return None
        ranks = ranks[:fits]
    groups = {r: {g for g, _ in p} for r, p in progs.items()}
    conflicts: dict[int, set[int]] = {r: set() for r in ranks}
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            shared = groups[a] & groups[b]
            pa = [x for x in progs[a] if x[0] in shared]
            pb = [x for x in progs[b] if x[0] in shared]
            if any(x != y for x, y in zip(pa, pb, strict=False)):
                conflicts[a].add(b)
                conflicts[b].add(a)
    centers = [r for r, c in conflicts.items() if len(c) >= 2]
    if len(centers) != 1:
        return None
    x = centers[0]
    return x if all(c == {x} for r, c in conflicts.items() if r != x and c) else None


def mismatches(ev: Evidence) -> tuple[str, int, list[int], list[int]] | None:
    """The first (group, seq) where members ran different ops: (group, seq, minority, majority), or None."""
    table: dict[tuple[str, int], dict[int, tuple[str, str]]] = {}
    for r, d in ev.dumps.items():
        for o in d.ops:
            if not o.p2p:
                table.setdefault((o.group, o.seq), {})[r] = (o.op, o.sizes)
    for (group, seq), ops in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        votes = Counter(ops.values())
        if len(votes) < 2:
            continue
        top, count = votes.most_common(1)[0]
        if 2 * count > len(ops):
            return group, seq, sorted(r for r, v in ops.items() if v != top), sorted(r for r, v in ops.items()
                                                                                     if v == top)
        return group, seq, [], sorted(ops)
    return None
