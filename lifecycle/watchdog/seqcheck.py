"""Collective-sequence check at phase boundaries: divergent collective counts found before they hang.

Every rank counts the collectives it issued per group label (``ctx.ops``). At each success
transition (a phase hook) every rank publishes its counts on the store and they are compared among
the members of each group. All ranks must take part (hooks run in the same order on every rank).

Cost: every rank publishes its counts (one un-acknowledged ``set``) and a 64-bit digest of them; the
common case (every rank has the same counts) is settled by the last rank to arrive from the list of
distinct digests, so each rank makes about six store calls per boundary whatever the world size. Only
when digests differ (pipeline stages legitimately count different groups, or a real divergence) does
the last arriver read every rank's counts once and compare them group by group.

Before it can hang: a rank that skipped (or added) a collective reaches the boundary while a peer is
still blocked in that collective. While waiting at the boundary, a rank reads the watchdog records of
the members of its small groups; a member blocked in op #k of a group on which this rank finished the
phase with fewer than k ops will wait forever: that is reported at once (``SequenceMismatch``), not at
the deadline.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

from lifecycle.errors import HangError, SequenceMismatch
from lifecycle.jsontypes import JsonDict
from lifecycle.watchdog.members import EVERY_RANK, members_of
from lifecycle.watchdog.tracker import deadline_key

if TYPE_CHECKING:
    from torch.distributed import Store

    from lifecycle.watchdog.run import CheckedRun

log = logging.getLogger(__name__)
PROBE_MAX_GROUP = 64  # larger groups are left to the deadline (reading their records costs O(size))
_PROBE_AFTER_S = 0.3


class SequenceCheck:
    """The phase hook. ``ctx.phase_hooks.append(SequenceCheck())``; skips failure transitions."""

    def __init__(self) -> None:
        self.index = 0
        self._groups: dict[str, tuple[int, int] | None] = {}

    def __call__(self, ctx: CheckedRun, old: str | None, new: str, failure: bool) -> None:
        if failure or old is None or ctx.comms.store is None or ctx.world_size == 1:
            return
        self.index += 1
        counts = self.counts(ctx)
        with ctx.events.span("sequence_check", boundary=f"{old}->{new}", labels=len(counts)):
            check(ctx, f"lifecycle/seq/{self.index}", counts, old)

    def counts(self, ctx: CheckedRun) -> dict[str, list[int]]:
        """``{label: [ops, first rank of the group, group size]}`` for every label this rank used."""
        out = {}
        for label, n in sorted(ctx.ops.snapshot()[0].items()):
            if label not in self._groups:
                ranks = members_of(ctx, label)
                self._groups[label] = (ranks[0], len(ranks)) if ranks else None
            group = self._groups[label]
            if group is not None:
                out[label] = [int(n), *group]
        return out


def digest(counts: dict[str, list[int]]) -> str:
    flat = sorted((label, c[0]) for label, c in counts.items())
    return hashlib.sha1(json.dumps(flat).encode()).hexdigest()[:16]


def check(ctx: CheckedRun, base: str, counts: dict[str, list[int]], phase: str) -> None:
    """Publish this rank's counts and wait for the verdict. Every rank must call it with the same ``base``."""
    store, rank, world = ctx.require_store(), ctx.rank, ctx.world_size
    mine = digest(counts)
    store.set(f"{base}/r/{rank}", json.dumps(counts))
    if int(store.add(f"{base}/d/{mine}", 1)) == 1:
        store.append(f"{base}/digests", mine + ",")
    if int(store.add(f"{base}/n", 1)) == world:
        verdict = judge(store, base, world)
        store.set(f"{base}/verdict", verdict)
    else:
        verdict = _await(ctx, base, phase)
    _leave(store, base, world)
    if verdict != "ok":
        found = json.loads(verdict)
        raise SequenceMismatch(describe(found, phase), phase=phase, rank=rank, group=found[0]["group"],
                               ranks=disagreeing(found))


def judge(store: Store, base: str, world: int) -> str:
    """``ok``, or the JSON list of mismatches (the last rank to arrive calls it)."""
    digests = {d for d in bytes(store.get(f"{base}/digests")).decode().split(",") if d}
    if len(digests) <= 1:
        return "ok"
    values = store.multi_get([f"{base}/r/{r}" for r in range(world)])
    found = compare({r: json.loads(bytes(v).decode()) for r, v in enumerate(values)})
    return json.dumps(found) if found else "ok"


def compare(per_rank: dict[int, dict[str, list[int]]]) -> list[JsonDict]:
    """Groups (label, first rank) whose members counted different numbers of ops. Pure."""
    buckets: dict[tuple[str, int], dict[int, int]] = {}
    sizes: dict[tuple[str, int], int] = {}
    for rank, counts in per_rank.items():
        for label, (n, first, size) in counts.items():
            buckets.setdefault((label, first), {})[rank] = n
            sizes[(label, first)] = size
    out = []
    for (label, first), by_rank in sorted(buckets.items()):
        if len(set(by_rank.values())) > 1 or len(by_rank) < sizes[(label, first)]:
            out.append({"group": label, "first_rank": first, "size": sizes[(label, first)],
                        "counts": {str(r): n for r, n in sorted(by_rank.items())}})
    return out


def disagreeing(mismatches: list[JsonDict]) -> list[int]:
    """Ranks whose count differs from the one most common count of their group (all of them on a tie)."""
    out: set[int] = set()
    for m in mismatches:
        counts = {int(r): n for r, n in m["counts"].items()}
        tally = Counter(counts.values()).most_common()
        unique = len(tally) == 1 or tally[0][1] > tally[1][1]
        out.update(r for r, n in counts.items() if not unique or n != tally[0][0])
    return sorted(out)


def describe(mismatches: list[JsonDict], phase: str) -> str:
    parts = []
    for m in mismatches[:8]:
        counts = m["counts"]
        silent = m["size"] - len(counts)
        parts.append(f"group {m['group']} (ranks from {m['first_rank']}, size {m['size']}): ops per rank {counts}"
                     + (f", {silent} member(s) issued none" if silent else ""))
    return (f"collective sequence mismatch at the end of phase {phase}: " + "; ".join(parts)
            + ". A rank skipped or added a collective: the next op on that group would hang")


def _await(ctx: CheckedRun, base: str, phase: str) -> str:
    limit = ctx.deadlines.deadline(deadline_key(phase))
    store, deadline = ctx.require_store(), time.monotonic() + limit
    probe_at, delay = time.monotonic() + _PROBE_AFTER_S, 0.002
    while not store.check([f"{base}/verdict"]):
        now = time.monotonic()
        if now > deadline:
            late = [r for r in range(ctx.world_size) if not store.check([f"{base}/r/{r}"])]
            raise HangError(f"sequence check at the end of phase {phase}: ranks {late} did not arrive within "
                            f"{limit:g}s", missing=late, phase=phase, rank=ctx.rank, group="world",
                            deadline_s=limit)
        if now >= probe_at:
            blocked = probe(ctx, phase)
            if blocked:
                raise SequenceMismatch(blocked[0], phase=phase, rank=ctx.rank, group=blocked[1], ranks=blocked[2])
            probe_at = now + 0.5
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return bytes(store.get(f"{base}/verdict")).decode()


def probe(ctx: CheckedRun, phase: str) -> tuple[str, str, list[int]] | None:
    """A member of one of this rank's small groups blocked in an op this rank will not issue in ``phase``."""
    wd = ctx.watchdog
    if wd is None:
        return None
    begun = wd.progress.record()["begun"]
    peers: set[int] = set()
    for label in begun:
        ranks = members_of(ctx, label)
        if ranks and len(ranks) <= PROBE_MAX_GROUP:
            peers.update(ranks)
    for m, rec in sorted(wd.peer_records(sorted(peers - {ctx.rank})).items()):
        if rec is None or rec.get("phase") != phase or not rec.get("op"):
            continue
        name, label, seq, _ = rec["op"]
        done = int(begun.get(label, 0))
        members = rec.get("ranks") or (list(range(ctx.world_size)) if label in EVERY_RANK else [])
        if ctx.rank in members and seq > done:
            pair = sorted({m, ctx.rank})
            return (f"collective sequence mismatch on group {label}: rank {m} is blocked in its op #{seq} on "
                    f"{label} ({name}) but rank {ctx.rank} finished phase {phase} after {done} op(s) on {label}: "
                    f"ranks {pair} disagree (one skipped or added a collective)", label, pair)
    return None


def _leave(store: Store, base: str, world: int) -> None:
    # The last rank to read the verdict deletes the keys, so a long run does not grow the store.
    if int(store.add(f"{base}/left", 1)) != world:
        return
    digests = [d for d in bytes(store.get(f"{base}/digests")).decode().split(",") if d]
    keys = [f"{base}/r/{r}" for r in range(world)] + [f"{base}/d/{d}" for d in digests]
    for key in [*keys, f"{base}/digests", f"{base}/n", f"{base}/verdict", f"{base}/left"]:
        try:
            store.delete_key(key)
        except RuntimeError:  # stores without delete_key keep them: harmless
            return
