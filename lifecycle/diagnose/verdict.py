"""One verdict from all the evidence: who is the culprit, where, why, and what would have prevented it.

The rules, strongest evidence first; each names a rank only from what that rank's own evidence (or PyTorch,
naming it) says, never by elimination — a rank nobody heard from is *missing evidence*, not a culprit:

1. lifecycle's own hang report (a run directory): its culprits, cause and phase.
2. A rank that crashed: it raised an exception that is not the consequence of a peer (a timeout, a closed
   connection, an aborted group, the launcher's SIGTERM), or died by a signal the launcher did not send.
3. Ranks PyTorch itself named: its desync report, a monitored barrier, the store key of a rank that never came.
4. The wait graph (:mod:`waits`): ranks others wait for that wait for nobody ("never entered" the op).
5. Ranks that wait for each other (a cycle): "diverged", the cycle's ranks as suspects (an order of collectives is
   no proof of who departed from it); ops of one sequence number that differ on a strict minority of a group's
   members name that minority ("diverged").
6. Everyone entered and nobody finished, or a network error names both ends of a link: no rank is named
   ("entered, not finished" / "network link"), the hosts are.
Otherwise culprits is empty and ``missing`` says what would settle it. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lifecycle.diagnose import facts as F
from lifecycle.diagnose import lines, waits
from lifecycle.diagnose.facts import Evidence, Fact
from lifecycle.jsontypes import JsonDict

MAX_EVIDENCE = 40


@dataclass
class Verdict:
    culprits: list[int] = field(default_factory=list)
    cause: str | None = None
    group: str | None = None
    seq: int | None = None
    op: str | None = None
    stage: str | None = None
    suspects: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    detail: str = ""
    step: int | None = None

    def cite(self, *where: str) -> None:
        for w in where:
            if w and w not in self.evidence and len(self.evidence) < MAX_EVIDENCE:
                self.evidence.append(w)


def decide(ev: Evidence, g: waits.Graph | None = None) -> Verdict:
    g = g if g is not None else waits.graph(ev)
    for rule in (_report, _crashed, _named, _roots, _cycle, _mismatch, _stuck_together):
        v = rule(ev, g)
        if v is not None:
            break
    else:
        v = Verdict(cause=_weak_cause(ev), detail=_undecided(ev))
    _where(ev, g, v)
    _missing(ev, g, v)
    return v


def _report(ev: Evidence, g: waits.Graph) -> Verdict | None:
    reports = ev.of(F.REPORT)
    if not reports:
        return None
    r = reports[0]
    v = Verdict(sorted(r.ranks), r.cause, r.group, r.seq, r.op, r.stage, detail=r.detail)
    v.cite(r.where)
    return v


def first_exceptions(ev: Evidence) -> dict[int, Fact]:
    """Each rank's first exception (crash or consequence), in the order its files gave them."""
    out: dict[int, Fact] = {}
    for f in ev.facts:
        if f.kind in (F.CRASH, F.CONSEQUENCE) and f.rank is not None:
            out.setdefault(f.rank, f)
    return out


def _crashed(ev: Evidence, g: waits.Graph) -> Verdict | None:
    first = first_exceptions(ev)
    crashed = {r: f for r, f in first.items() if f.kind == F.CRASH}
    waited = {f.rank for f in ev.facts if f.kind == F.TIMEOUT}
    for f in ev.of(F.KILLED):
        exc = first.get(f.rank) if f.rank is not None else None
        if f.rank is None or (exc is not None and exc.kind == F.CONSEQUENCE) or f.rank in waited:
            continue  # it died after a peer failed (NCCL's watchdog ends a rank with SIGABRT after a timeout)
        crashed.setdefault(f.rank, f)
    if not crashed:
        return None
    v = Verdict(sorted(crashed), "crashed", detail="; ".join(f"rank {r}: {f.detail[:200]}"
                                                             for r, f in sorted(crashed.items())[:8]))
    v.cite(*(f.where for f in crashed.values()))
    v.stage = next((f.stage for f in crashed.values() if f.stage), None)
    return v


def _named(ev: Evidence, g: waits.Graph) -> Verdict | None:
    found: dict[int, Fact] = {}
    for f in ev.of(F.NAMED):
        ranks = _global(ev, g, f)
        for r in ranks or ():
            found.setdefault(r, f)
    if not found:
        return None
    first = next(iter(found.values()))
    v = Verdict(sorted(found), first.cause, first.group, first.seq, stage=first.stage, detail=first.detail)
    v.cite(*(f.where for f in found.values()))
    return v


def _global(ev: Evidence, g: waits.Graph, f: Fact) -> list[int] | None:
    """The global ranks a PyTorch report names (group ranks): as they are on the default group, mapped through
    the group's known members on another, None when the group is not known."""
    group = f.group
    if group is None:
        only_default = all(k == F.DEFAULT for k in ev.descs) and not ev.members
        group = F.DEFAULT if only_default else None
    if group == F.DEFAULT:
        return list(f.ranks)
    members = ev.members.get(group or "")
    if members is None:
        return None
    return [members[r] for r in f.ranks if r < len(members)]


def _roots(ev: Evidence, g: waits.Graph) -> Verdict | None:
    roots = g.roots
    if not roots:
        return None
    edges = [w for w in g.waits.values() if set(w.missing) & set(roots)]
    w = g.first_wait(roots) or edges[0]
    edges.sort(key=lambda x: x is not w)
    said = "; ".join(f"rank {x.rank} in {x.op or 'op'} #{x.seq} of group {x.group}"
                     + (f" ({ev.descs[x.group]})" if ev.descs.get(x.group) else "") for x in edges[:6])
    v = Verdict(roots, "never entered", w.group, w.seq, w.op,
                detail=f"rank(s) {_short(roots)} never entered the op others wait in: {said}")
    mismatch = waits.mismatches(ev)
    if mismatch and set(mismatch[2]) & set(roots):
        v.cause = "diverged"
    v.cite(*(x.where for x in edges), *(ev.dumps[r].where for r in roots if r in ev.dumps))
    v.cite(*(f.where for f in ev.facts if f.kind == F.PROGRESS and f.rank in roots))
    return v


def _cycle(ev: Evidence, g: waits.Graph) -> Verdict | None:
    cycle = g.cycle()
    if not cycle:
        return None
    m = waits.mismatches(ev)
    if m is not None and m[2] and set(m[2]) <= set(cycle):  # one op differs on a strict minority of its group
        return _mismatch(ev, g)
    compared = sorted(set(cycle) | {m for r in cycle for m in g.waits[r].missing})
    odd = waits.departed(ev, compared)
    w = g.waits[odd if odd is not None and odd in g.waits else cycle[0]]
    if odd is not None:
        v = Verdict([odd], "diverged", w.group, w.seq, w.op,
                    detail=f"ranks {_short(cycle)} wait for each other: their orders of collectives differ; rank {odd}'s "
                           f"order conflicts with several ranks that agree with each other (two ranks run the ops of "
                           f"the groups they share in one order)")
    else:
        v = Verdict([], "diverged", w.group, w.seq, w.op, suspects=cycle,
                    detail=f"ranks {_short(cycle)} wait for each other: their orders of collectives differ (a skipped "
                           f"op, another group first); which of them departed is not proven by their dumps")
    v.cite(*(g.waits[r].where for r in cycle))
    return v


def _mismatch(ev: Evidence, g: waits.Graph) -> Verdict | None:
    m = waits.mismatches(ev)
    if m is None:
        return None
    group, seq, minority, majority = m
    v = Verdict(minority, "diverged", group, seq, suspects=[] if minority else majority,
                detail=f"op #{seq} of group {group} is not the same op on every member")
    v.cite(*(ev.dumps[r].where for r in minority + majority if r in ev.dumps))
    return v


def _stuck_together(ev: Evidence, g: waits.Graph) -> Verdict | None:
    links = ev.of(F.LINK)
    if links:
        v = Verdict(cause="network link", hosts=sorted({h for f in links for h in (f.host, f.peer) if h}),
                    detail="a network error names both ends of a link")
        v.cite(*(f.where for f in links))
        return v
    if g.waits and not g.blocked and ev.of(F.TIMEOUT):
        v = Verdict(cause="entered, not finished", detail="every member entered the op and none finished it")
        v.cite(*(w.where for w in g.waits.values()))
        return v
    return None


def _weak_cause(ev: Evidence) -> str | None:
    """What the failures seen say when no rank is named: a rendezvous that timed out, or nothing decided."""
    if any(f.stage == "init" for f in ev.facts if f.kind == F.CONSEQUENCE):
        return "rendezvous"
    return None


def _undecided(ev: Evidence) -> str:
    waited = sorted({f.rank for f in ev.facts if f.kind in (F.CONSEQUENCE, F.TIMEOUT) and f.rank is not None})
    if not waited:
        return "the evidence names no rank"
    return (f"rank(s) {_short(waited)} failed waiting on their peers (timeouts, closed connections); the evidence "
            f"does not say which rank they waited for")


def _where(ev: Evidence, g: waits.Graph, v: Verdict) -> None:
    """Group, op and stage from where the others waited, when the rule did not say."""
    edge = g.first_wait(v.culprits)
    if edge is not None and v.group is None:
        v.group, v.seq, v.op = edge.group, edge.seq, edge.op
    victims = [f for f in ev.facts if f.kind in (F.CONSEQUENCE, F.TIMEOUT) and f.rank not in v.culprits]
    if v.op is None:
        v.op = next((f.op for f in victims if f.op), None)
    v.stage = v.stage or _stage(ev, g, v, victims)
    steps = [f.seq for f in ev.of(F.STAGE) if f.seq is not None]
    v.step = max(steps) + 1 if steps else None  # the step after the last one the job logged as done
    if v.cause == "rendezvous":
        v.stage = "init"


def _stage(ev: Evidence, g: waits.Graph, v: Verdict, victims: list[Fact]) -> str | None:
    hints = [lines.stage_of(w.frames) for w in g.waits.values() if w.frames and set(w.missing) & set(v.culprits)]
    hints += [f.stage for f in victims] + [f.stage for f in ev.facts if f.rank in v.culprits]
    for stage in ("init", "checkpoint", "exit", "warmup"):
        if stage in hints:
            return stage
    if v.seq is not None:
        return "first step" if v.seq == 1 else "train"
    return "train" if ev.of(F.STAGE) else None


def _missing(ev: Evidence, g: waits.Graph, v: Verdict) -> None:
    if v.culprits and v.cause != "diverged":
        return
    needs: list[str] = []
    if not ev.dumps:
        needs.append("Flight Recorder dumps of every rank (TORCH_FR_BUFFER_SIZE=2000; on NCCL also "
                     "TORCH_NCCL_DUMP_ON_TIMEOUT=1, which writes them on a timeout; on gloo the job must call "
                     "torch._C._distributed_c10d._dump_fr_trace() when it fails): each rank's own last op decides")
    known = set(ev.dumps) | set(ev.present) | {f.rank for f in ev.facts if f.rank is not None}
    everyone = set(range(ev.world)) if ev.world else set()
    if everyone - known:
        needs.append(f"logs or dumps of rank(s) {_short(sorted(everyone - known))}")
    nodump = sorted(known - set(ev.dumps)) if ev.dumps else []
    if nodump:
        needs.append(f"Flight Recorder dumps of rank(s) {_short(nodump)} (the others have theirs)")
    if not ev.of(F.KILLED) and not ev.of(F.TERMINATED):
        needs.append("the launcher's own output (torchrun's failure summary gives each rank's exit code and signal)")
    if ev.unattributed:
        needs.append(f"the global rank of {ev.unattributed} line(s) whose prefix gives only a local rank "
                     "(the node's torchrun console, or [rankN]: prefixes)")
    if v.cause == "diverged" and not v.culprits:
        needs.append("dumps of more members of the group: a strict majority of ranks shows the order that was meant")
    needs += _unresolved(ev, g)
    needs += [f"a usable form of {u}" for u in ev.unusable[:4]]
    hidden = sorted(r for r in g.named if r in g.hidden)
    if hidden and not v.culprits:
        v.suspects = v.suspects or hidden[:64]
        needs.append(f"proof that rank(s) {_short(hidden)} wait in no send or receive: their gloo dumps show them past "
                     f"every collective they entered, but gloo records no point-to-point op ({g.hidden[hidden[0]]}): "
                     f"for a job without a pipeline, diagnose -w N -o ... with its layout decides; with one, NCCL's "
                     f"dumps (which record sends and receives) do")
    quiet = [r for r in g.named if r not in g.free and r not in g.blocked and r not in g.unresolved
             and r not in g.hidden]
    if quiet and not v.culprits:
        v.suspects = v.suspects or sorted(quiet)[:64]
        needs.append(f"Flight Recorder dumps of rank(s) {_short(sorted(quiet))}: others wait for them, and their logs "
                     f"do not prove they wait for nobody (a line speaks of one group; they may wait in another)")
    if not ev.world:
        needs.append("the world size (torchrun's --log-dir tree, or diagnose -w N with the job's -o layout)")
    v.missing = needs


def _unresolved(ev: Evidence, g: waits.Graph) -> list[str]:
    """What would prove where the unresolved ranks wait: their groups' other members' dumps, or the membership."""
    by_group: dict[str, list[int]] = {}
    for rank, groups in sorted(g.unresolved.items()):
        for group in groups:
            by_group.setdefault(group, []).append(rank)
    out = []
    for group, ranks in sorted(by_group.items(), key=lambda kv: -len(kv[1]))[:4]:
        desc = f" ({ev.descs[group]})" if ev.descs.get(group) else ""
        seen = g.members.get(group, [])
        out.append(f"who else is in group {group}{desc} and how far they got: rank(s) {_short(ranks)} entered an op "
                   f"there that no member is proven to have left, and only rank(s) {_short(seen)} of it are known "
                   f"(dumps of every rank, also on SIGTERM: a stalled rank never reaches its own exception handler; "
                   f"NCCL's dumps record each group's members; on gloo diagnose -w N -o ... gives them)")
    return out


def _short(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")


def as_json_group(ev: Evidence, g: waits.Graph, v: Verdict) -> JsonDict | None:
    if v.group is None:
        return None
    return {"name": v.group, "desc": ev.descs.get(v.group) or None, "ranks": g.members.get(v.group)}
