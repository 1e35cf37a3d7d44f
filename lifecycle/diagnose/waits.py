"""Who waits for whom, from each rank's own count of the ops it entered on each group.

A rank's position on a group is the highest collective sequence number it entered there (``enq``): from its Flight
Recorder dump, or from ProcessGroupNCCL's ``last enqueued work`` lines. A rank waits in op ``S`` of group ``G`` when
that is the last op it entered (its dump's last entry, or the op its watchdog timed out in). It waits *for* the
members of ``G`` whose own position there is known and below ``S``: they never entered the op. A rank is named only
from its own position: a member whose position is unknown is never assumed behind.

A rank others wait for that waits for nobody is a root (:attr:`Graph.roots`). Ranks that wait for each other form a
cycle: their orders of collectives differ (a skipped op, another group first); the one whose order departs from
what a strict majority of ranks did at the same place is the one that diverged (:func:`deviators`). Ops with the
same sequence number on one group but a different name or size on some members are a mismatch
(:func:`mismatches`). Pure Python.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from lifecycle.diagnose import facts as F
from lifecycle.diagnose.facts import Evidence


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

    @property
    def blocked(self) -> set[int]:
        return {r for r, w in self.waits.items() if w.missing}

    @property
    def named(self) -> set[int]:
        return {m for w in self.waits.values() for m in w.missing}

    @property
    def roots(self) -> list[int]:
        return sorted(self.named - self.blocked)

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


def _known(ev: Evidence, rank: int, group: str, enq: dict[int, dict[str, int]], members: list[int]) -> int | None:
    mine = enq.get(rank)
    if mine is None:
        return None
    if group in mine:
        return mine[group]
    dump = ev.dumps.get(rank)
    if dump is not None and not dump.wrapped and rank in members:
        return 0  # a complete dump of a member with no op on the group: it never entered one
    return None


def graph(ev: Evidence) -> Graph:
    enq = positions(ev)
    groups = members(ev, enq)
    waits = {w.rank: w for w in _waits(ev)}
    for w in waits.values():
        ranks = groups.get(w.group, [])
        w.missing = [m for m in ranks if m != w.rank and (k := _known(ev, m, w.group, enq, ranks)) is not None
                     and k < w.seq]
    return Graph(waits, enq, groups)


def _waits(ev: Evidence) -> list[Wait]:
    out: dict[int, Wait] = {}
    for rank, dump in sorted(ev.dumps.items()):
        ops = [o for o in dump.ops if not o.p2p]
        if ops:
            last = ops[-1]
            out[rank] = Wait(rank, last.group, last.seq, last.op, dump.where, last.frames, record=last.record)
    for fact in ev.facts:
        if fact.rank is None or fact.rank in ev.dumps or fact.group is None:
            continue
        if fact.kind in (F.PROGRESS, F.TIMEOUT) and fact.seq is not None:
            out[fact.rank] = Wait(fact.rank, fact.group, fact.seq, fact.op, fact.where)
        elif fact.kind == F.PROGRESS and fact.enq is not None and fact.done is not None and fact.done < fact.enq:
            out.setdefault(fact.rank, Wait(fact.rank, fact.group, fact.done + 1, None, fact.where))
    return list(out.values())


def role(ev: Evidence, group: str) -> str:
    """What a group is across ranks: its description when it has one (every tp group is "tp"), else its name."""
    desc = ev.descs.get(group, "")
    return desc if desc and desc != "undefined" else group


def deviators(ev: Evidence, ranks: list[int]) -> list[int]:
    """Of ``ranks``, those whose sequence of (group role, op) departs first from what a strict majority of the
    dumped ranks did at the same position (entries aligned by record id)."""
    seqs = {r: [(role(ev, o.group), o.op) for o in d.ops if not o.p2p] for r, d in ev.dumps.items()}
    if len(seqs) < 3:
        return []
    first: dict[int, int] = {}
    for r in ranks:
        for i, item in enumerate(seqs.get(r, [])):
            votes = Counter(s[i] for s in seqs.values() if len(s) > i)
            top, count = votes.most_common(1)[0]
            if 2 * count > sum(votes.values()) and item != top:
                first[r] = i
                break
    if not first:
        return []
    earliest = min(first.values())
    return sorted(r for r, i in first.items() if i == earliest)


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
