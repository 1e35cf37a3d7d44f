"""Generated failures for ``lifecycle diagnose``: a seeded generator of jobs, one fault each, and the evidence they
would leave, with parts of it lost. Pure Python (no torch).

A case is a layout (Megatron-shaped tp/cp/ep/dp/pp groups, or arbitrary ``new_group`` sets) at a world of 2 ... 1024,
every rank's program over it (collectives in one global order; pipeline stages' sends and receives, one at a time
or in batches as an interleaved schedule posts them), and one fault on one rank: a stall before, between or inside
an op, a crash with an exit code, an exception, a skipped op, another op or size, a slow rank, a rank that never
reaches ``init_process_group``. :func:`simulate` runs the programs to the hang: a collective finishes when every
member entered it, a send when its peer entered the matching receive (and back). What each rank then holds is
rendered as PyTorch writes it: Flight Recorder dumps (pickle or JSON, versions 2.2 ... 2.10; gloo-style, every
entry ``scheduled`` and no group membership, or NCCL-style, with states and ``pg_config``; ring buffers that
wrapped), log lines (gloo's timeout tracebacks, NCCL's watchdog lines, the injected exception) and torchrun's failure
summary; then any subset of them is lost, the culprit's dump included. :func:`check` runs the real ``diagnose`` on
the files and returns the verdict with the truth.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from lifecycle.diagnose import diagnose

FAULTS = ("stall_before", "stall_between", "stall_inside", "crash", "raise", "skip", "other_op", "slow", "no_init")
WORLDS = (2, 3, 4, 4, 6, 8, 8, 12, 16, 16, 24, 32, 64)
MEGATRON_DESC = {"tp": "TENSOR_MODEL_PARALLEL_GROUP", "cp": "CONTEXT_PARALLEL_GROUP", "dp": "DATA_PARALLEL_GROUP",
                 "pp": "PIPELINE_MODEL_PARALLEL_GROUP", "ep": "EXPERT_MODEL_PARALLEL_GROUP"}
C10D = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"
P2P = "/usr/lib/python3/site-packages/megatron/core/pipeline_parallel/p2p_communication.py"
GLOO_TIMEOUT = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 4000ms for recv operation to complete")
NCCL_OP = {"all_reduce": "ALLREDUCE", "all_gather": "ALLGATHER", "reduce_scatter": "REDUCE_SCATTER",
           "broadcast": "BROADCAST", "all_to_all": "ALLTOALL_BASE", "send": "SEND", "recv": "RECV"}


@dataclass(frozen=True)
class Group:
    guid: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Op:
    group: Group
    name: str
    size: int
    peer: int | None = None
    """A send's or receive's peer (global rank)."""


Step = tuple[Op, ...]
"""What a rank posts at once: one op, or a batch of sends and receives it then waits for together."""


@dataclass
class Case:
    seed: int
    world: int
    shape: str
    groups: list[Group]
    programs: dict[int, list[Step]]
    fault: str
    culprit: int
    at: int
    """The index of the faulty step in the culprit's program."""
    nccl: bool = False
    layout: dict[str, list[list[int]]] | None = None
    """The job's layout as ``diagnose -w N -o ...`` would give it (Megatron-shaped jobs only)."""
    records: dict[int, list[tuple[Op, int, str]]] = field(default_factory=dict)
    """rank -> (op, its sequence number on its group (collectives) or of its kind to its peer, state)."""
    stuck: set[int] = field(default_factory=set)
    """Ranks blocked in an op when the job hung (they time out)."""
    evidence: str = ""


Layout = dict[str, list[list[int]]]


def _megatron(rng: random.Random, world: int) -> tuple[list[Group], dict[int, list[Step]], str, Layout | None]:
    dims = {"tp": 1, "cp": 1, "pp": 1}
    rest = world
    for name in ("tp", "pp", "cp"):
        choices = [d for d in (1, 2, 4, 8) if rest % d == 0]
        dims[name] = rng.choice(choices)
        rest //= dims[name]
    tp, cp, pp, dp = dims["tp"], dims["cp"], dims["pp"], rest
    ep = rng.choice([d for d in (1, 2, 4) if dp % d == 0])  # experts over blocks of the data-parallel ranks
    interleaved = pp > 1 and rng.random() < 0.5
    megatron = rng.random() < 0.5

    def coord(r: int) -> tuple[int, int, int, int]:
        return r % tp, (r // tp) % cp, (r // (tp * cp)) % dp, r // (tp * cp * dp)

    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + cp * (d + dp * p))

    groups: list[Group] = []
    of: dict[tuple[str, int], Group] = {}
    families = {"tp": (tp, lambda r, i: rank(i, *coord(r)[1:])),
                "cp": (cp, lambda r, i: rank(coord(r)[0], i, coord(r)[2], coord(r)[3])),
                "dp": (dp, lambda r, i: rank(coord(r)[0], coord(r)[1], i, coord(r)[3])),
                "pp": (pp, lambda r, i: rank(*coord(r)[:3], i)),
                "ep": (ep, lambda r, i: rank(coord(r)[0], coord(r)[1], coord(r)[2] // ep * ep + i, coord(r)[3]))}
    for name, (size, member) in families.items():
        if size < 2:
            continue
        seen: set[tuple[int, ...]] = set()
        for r in range(world):
            ranks = tuple(sorted(member(r, i) for i in range(size)))
            if ranks not in seen:
                seen.add(ranks)
                g = Group(str(len(groups) + 1), MEGATRON_DESC[name] if megatron else name, ranks)
                groups.append(g)
        for r in range(world):
            of[(name, r)] = next(g for g in groups if r in g.ranks and g.desc in (name, MEGATRON_DESC[name]))
    default = Group("0", "default_pg", tuple(range(world)))
    iters = rng.randint(2, 4)
    programs: dict[int, list[Step]] = {}
    for r in range(world):
        stage = coord(r)[3]
        prev = rank(*coord(r)[:3], stage - 1) if stage > 0 else None
        nxt = rank(*coord(r)[:3], stage + 1) if stage < pp - 1 else None
        prog: list[Step] = []

        def coll(name: str, op: str, size: int, r: int = r, prog: list[Step] = prog) -> None:
            if (name, r) in of:
                prog.append((Op(of[(name, r)], op, size),))

        for _ in range(iters):
            pg = of.get(("pp", r))
            if interleaved and pg is not None:
                coll("tp", "all_reduce", 16)
                coll("ep", "all_to_all", 32)
                coll("ep", "all_to_all", 32)
                coll("cp", "all_gather", 8)
                if prev is not None:  # exchange with the previous stage first, then the next: a chain, no deadlock
                    prog.append((Op(pg, "send", 4, prev), Op(pg, "recv", 4, prev)))
                if nxt is not None:
                    prog.append((Op(pg, "send", 4, nxt), Op(pg, "recv", 4, nxt)))
                coll("tp", "all_reduce", 16)
            else:
                if prev is not None and pg is not None:
                    prog.append((Op(pg, "recv", 4, prev),))
                coll("tp", "all_reduce", 16)
                coll("ep", "all_to_all", 32)  # a zero-token rank that skips these is the "skip" fault
                coll("ep", "all_to_all", 32)
                coll("cp", "all_gather", 8)
                if nxt is not None and pg is not None:
                    prog.append((Op(pg, "send", 4, nxt),))
                    prog.append((Op(pg, "recv", 4, nxt),))
                coll("tp", "all_reduce", 16)
                if prev is not None and pg is not None:
                    prog.append((Op(pg, "send", 4, prev),))
            coll("dp", "all_reduce", 64)
            prog.append((Op(default, "all_reduce", 1),))
        programs[r] = prog
    shape = f"megatron tp{tp} cp{cp} ep{ep} dp{dp} pp{pp}" + (" interleaved" if interleaved else "")
    layout: Layout = {name: sorted({tuple(sorted(member(r, i) for i in range(size))) for r in range(world)})
                      for name, (size, member) in families.items()}  # type: ignore[misc]
    layout = {k: [list(g) for g in v] for k, v in layout.items()}
    layout["world"] = [list(range(world))]
    return groups, programs, shape, layout


def _new_groups(rng: random.Random, world: int) -> tuple[list[Group], dict[int, list[Step]], str, Layout | None]:
    groups: list[Group] = []
    for _ in range(rng.randint(1, 6)):
        size = rng.randint(2, world) if world > 2 else 2
        groups.append(Group(str(len(groups) + 1), rng.choice(["", "undefined", "mine", "ep"]),
                            tuple(sorted(rng.sample(range(world), size)))))
    default = Group("0", "default_pg", tuple(range(world)))
    slots = [rng.choice(groups) for _ in range(rng.randint(2, 8))] + [default]
    ops = [(g, rng.choice(["all_reduce", "all_gather", "broadcast"]), rng.choice([1, 4, 16])) for g in slots]
    iters = rng.randint(2, 3)
    programs = {r: [(Op(g, n, s),) for _ in range(iters) for g, n, s in ops if r in g.ranks] for r in range(world)}
    return groups, programs, f"{len(groups)} new_group sets", None


def make(seed: int, *, big: bool = False) -> Case:
    rng = random.Random(seed)
    world = rng.choice((128, 256, 1024)) if big else rng.choice(WORLDS)
    groups, programs, shape, layout = (_megatron if rng.random() < 0.65 else _new_groups)(rng, world)
    fault = rng.choice(FAULTS)
    culprit = rng.randrange(world)
    prog = programs[culprit]
    at = rng.randrange(len(prog))
    if fault in ("skip", "other_op"):
        colls = [i for i, step in enumerate(prog) if len(step) == 1 and step[0].peer is None]
        at = rng.choice(colls)
    if fault == "stall_before":
        at = next((i for i, step in enumerate(prog) if i >= at and step[0].group.guid == "0"), at)
    case = Case(seed, world, shape, groups, programs, fault, culprit, at, nccl=rng.random() < 0.4,
                layout=layout if rng.random() < 0.3 else None)
    simulate(case)
    return case


def simulate(case: Case) -> None:
    """Run every program until nothing moves; ``case.records`` and ``case.stuck`` are what the hang leaves."""
    progs = {r: list(p) for r, p in case.programs.items()}
    x, at, fault = case.culprit, case.at, case.fault
    if fault == "skip":
        progs[x] = progs[x][:at] + progs[x][at + 1:]
    if fault == "other_op":
        (op,) = progs[x][at]
        other = ("all_gather" if op.name == "all_reduce" else "all_reduce", op.size) if op.size == 1 or \
            (op.size % 2) else (op.name, op.size * 2)
        progs[x][at] = (Op(op.group, other[0], other[1]),)
    stop = at if fault in ("stall_before", "stall_between", "crash", "raise", "slow") else None
    if fault == "no_init":
        case.records = {r: [] for r in progs}
        case.stuck = set(progs) - {x}
        return
    pc = dict.fromkeys(progs, 0)
    entered = dict.fromkeys(progs, False)
    coll: dict[tuple[int, str], list[tuple[str, int]]] = {}
    p2p: dict[tuple[int, str, int, str], int] = {}
    records: dict[int, list[tuple[Op, int, str]]] = {r: [] for r in progs}
    mine: dict[int, list[tuple[Op, int]]] = {}
    poisoned: set[int] = set()
    moved = True
    while moved:
        moved = False
        for r, prog in progs.items():
            if pc[r] >= len(prog) or (r == x and stop is not None and pc[r] == stop):
                continue
            step = prog[pc[r]]
            if not entered[r]:
                keys = []
                for op in step:
                    if op.peer is None:
                        coll.setdefault((r, op.group.guid), []).append((op.name, op.size))
                        keys.append((op, len(coll[(r, op.group.guid)])))
                    else:
                        k = (r, op.group.guid, op.peer, op.name)
                        p2p[k] = p2p.get(k, 0) + 1
                        keys.append((op, p2p[k]))
                    records[r].append((keys[-1][0], keys[-1][1], "scheduled"))
                mine[r] = keys
                entered[r] = True
                moved = True
                if r == x and fault == "stall_inside" and pc[r] == at:
                    poisoned.add(r)
            if r in poisoned or not all(_done(r, op, n, coll, p2p, poisoned) for op, n in mine[r]):
                continue
            base = len(records[r]) - len(step)
            for i in range(base, len(records[r])):
                records[r][i] = (*records[r][i][:2], "completed")
            pc[r] += 1
            entered[r] = False
            moved = True
    case.records = records
    case.stuck = {r for r in progs if entered[r] and pc[r] < len(progs[r])}


def _done(r: int, op: Op, n: int, coll: dict[tuple[int, str], list[tuple[str, int]]],
          p2p: dict[tuple[int, str, int, str], int], poisoned: set[int]) -> bool:
    if op.peer is None:
        want = coll[(r, op.group.guid)][n - 1]
        if any(len(coll.get((m, op.group.guid), ())) < n for m in op.group.ranks):
            return False
        for m in op.group.ranks:
            theirs = coll.get((m, op.group.guid), [])
            if len(theirs) < n or theirs[n - 1] != want:
                return False
        # an op the stalled rank is inside never finishes for anyone
        return not any(m in poisoned and len(coll.get((m, op.group.guid), [])) == n for m in op.group.ranks)
    other = "recv" if op.name == "send" else "send"
    return p2p.get((op.peer, op.group.guid, r, other), 0) >= n and op.peer not in poisoned


# ---- the evidence ---------------------------------------------------------------------------------------------


def render(case: Case, folder: Path, rng: random.Random) -> str:
    """Write what the job leaves under ``folder`` (some of it lost); returns the evidence class."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    x, fault = case.culprit, case.fault
    dead = {x} if fault in ("crash", "raise") else set()
    alive = set(range(case.world)) - dead
    on_sigterm = rng.random() < 0.5
    dumpers = set(alive) if (case.nccl or on_sigterm) else set(case.stuck)
    if fault == "raise" and rng.random() < 0.7:
        dumpers.add(x)  # its own exception handler ran
    if fault == "no_init":
        dumpers = set()
    lose = rng.choice((0.0, 0.0, 0.2, 0.5, 0.9))
    kept = {r for r in dumpers if rng.random() >= lose}
    if x in kept and rng.random() < 0.5:
        kept.discard(x)  # the dump most often lost in practice
    wrapped = rng.random() < 0.2
    as_json = rng.random() < 0.5
    version = f"2.{rng.randint(2, 10)}"
    for r in sorted(kept):
        _dump(case, r, folder, rng, wrapped, as_json, version)
    logs_kept = rng.random() < 0.8
    summary = rng.random() < 0.6
    if logs_kept:
        _console(case, folder, rng, summary, dead)
    cls = "nccl" if case.nccl else "gloo"
    dumps_cls = ("no dumps" if not kept else "every dump" if kept == set(range(case.world))
                 else "culprit's dump" if x in kept else "no culprit dump")
    case.evidence = f"{cls}, {dumps_cls}{', wrapped' if wrapped and kept else ''}" + \
        (", layout" if case.layout else "") + (", logs" + (" + summary" if summary else "") if logs_kept else "")
    return case.evidence


def _dump(case: Case, r: int, folder: Path, rng: random.Random, wrapped: bool, as_json: bool, version: str) -> None:
    records = case.records[r]
    if not case.nccl:
        records = [rec for rec in records if rec[0].peer is None]
    keep = rng.randint(2, 8) if wrapped else len(records)
    first = max(len(records) - keep, 0)
    entries = []
    p2p_seq: dict[str, int] = {}
    for i, (op, n, state) in enumerate(records):
        if op.peer is not None:
            p2p_seq[op.group.guid] = p2p_seq.get(op.group.guid, 0) + 1
            if not case.nccl:
                continue  # gloo's Flight Recorder records collectives only (torch 2.9 ... 2.13)
        if i < first:
            continue
        grank = op.group.ranks.index(r)
        name = op.name
        if op.peer is not None and case.nccl:
            peer = op.group.ranks.index(op.peer)
            name = f"{name} {grank}->{peer}" if op.name == "send" else f"{name} {grank}<-{peer}"
        if case.nccl:
            st = state if state == "completed" else rng.choice(("scheduled", "started"))
        else:
            st = "scheduled"
        entries.append({
            "record_id": i, "pg_id": int(op.group.guid), "process_group": [op.group.guid, op.group.desc],
            "collective_seq_id": n if op.peer is None else 0, "p2p_seq_id": p2p_seq.get(op.group.guid, 0),
            "op_id": i, "profiling_name": f"{'nccl' if case.nccl else 'gloo'}:{name}", "time_created_ns": 1000 + i,
            "input_sizes": [[op.size]], "output_sizes": [[op.size]], "state": st, "retired": True,
            "is_p2p": op.peer is not None,
            "frames": [{"name": op.name, "filename": C10D, "line": 3252}, {"name": "train_step",
                                                                           "filename": "train.py", "line": 10}]})
    if case.nccl:
        mine = [g for g in case.groups if r in g.ranks] + [Group("0", "default_pg", tuple(range(case.world)))]
        config = {g.guid: {"name": g.guid, "desc": g.desc, "ranks": str(list(g.ranks))} for g in mine}
    else:
        config = {"": {"name": "", "desc": "", "ranks": "[]"}}
    value = {"version": version, "pg_config": config, "pg_status": {}, "entries": entries}
    name = f"fr_trace_rank_{r}"
    if as_json:
        (folder / f"{name}.json").write_text(json.dumps(value))
    else:
        (folder / name).write_bytes(pickle.dumps(value, protocol=4))


def _console(case: Case, folder: Path, rng: random.Random, summary: bool, dead: set[int]) -> None:
    x, fault = case.culprit, case.fault
    lines: list[str] = []
    timed_out: list[int] = []
    for r in range(case.world):
        if rng.random() < 0.2:
            continue  # this rank's lines were lost
        lines.append(f"[rank{r}]: step 1: loss 4.0")
        if r == x and fault == "raise":
            lines += [f"[rank{r}]: Traceback (most recent call last):",
                      f'[rank{r}]:   File "train.py", line 120, in step_once',
                      f"[rank{r}]: ValueError: bad batch (injected)"]
        elif r == x and fault == "no_init":
            continue
        elif fault == "no_init":
            lines += [f"[rank{r}]: Traceback (most recent call last):",
                      f'[rank{r}]:   File "{C10D}", line 1700, in init_process_group',
                      f"[rank{r}]: torch.distributed.DistStoreError: Timed out after 61 seconds waiting for clients. "
                      f"{case.world - 1}/{case.world} clients joined."]
            timed_out.append(r)
        elif r in case.stuck and rng.random() < 0.8:
            op = case.records[r][-1][0]
            if case.nccl:
                grank = op.group.ranks.index(r)
                seq = case.records[r][-1][1]
                lines.append(f"[rank{r}]:[E1126 10:00:00.123456789 ProcessGroupNCCL.cpp:632] [PG ID 0 PG GUID "
                             f"{op.group.guid}({op.group.desc}) Rank {grank}] Watchdog caught collective operation "
                             f"timeout: WorkNCCL(SeqNum={seq}, OpType={NCCL_OP.get(op.name, 'ALLREDUCE')}, NumelIn=1,"
                             f" NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.")
            else:
                batched = op.peer is not None and any(len(step) > 1 for step in case.programs[r])
                where = (f'[rank{r}]:   File "{P2P}", line 200, in _batched_p2p_ops' if batched  # Megatron's
                         else f'[rank{r}]:   File "{C10D}", line 3252, in {op.name}')
                lines += [f"[rank{r}]: Traceback (most recent call last):", where,
                          f"[rank{r}]:     work.wait()", f"[rank{r}]: {GLOO_TIMEOUT}"]
            timed_out.append(r)
    if summary:
        lines += _summary(case, rng, dead, timed_out)
    (folder / "console.txt").write_text("\n".join(lines) + "\n")


def _summary(case: Case, rng: random.Random, dead: set[int], timed_out: list[int]) -> list[str]:
    """torchrun's failure summary: the first failure is the root cause, the rest were terminated (SIGTERM)."""
    x = case.culprit
    if dead:
        first, code = x, (1 if case.fault == "raise" else rng.choice((7, 3, 134, -9)))
    elif timed_out:
        first, code = rng.choice(timed_out), (-6 if case.nccl else 1)
    else:
        return []
    out = ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
           "============================================================", "train.py FAILED",
           "------------------------------------------------------------", "Failures:"]
    for i, r in enumerate(sorted(set(range(case.world)) - {first})[:64]):
        out += [f"[{i + 1}]:", "  time      : 2026-11-26_19:34:13", "  host      : node0", f"  rank      : {r} "
                f"(local_rank: {r})", f"  exitcode  : -15 (pid: {2000 + r})  (SIGTERM)", "  error_file: <N/A>",
                f"  traceback : Signal 15 (SIGTERM) received by PID {2000 + r}"]
    sig = "  (SIGKILL)" if code == -9 else "  (SIGABRT)" if code == -6 else " "
    out += ["------------------------------------------------------------", "Root Cause (first observed failure):",
            "[0]:", "  time      : 2026-11-26_19:34:13", "  host      : node0",
            f"  rank      : {first} (local_rank: {first})", f"  exitcode  : {code} (pid: {2000 + first}){sig}",
            "  error_file: <N/A>", "  traceback : To enable traceback see: "
            "https://pytorch.org/docs/stable/elastic/errors.html",
            "============================================================"]
    return out


@dataclass
class Outcome:
    case: Case
    culprits: list[int]
    cause: str | None

    @property
    def wrong(self) -> bool:
        return bool(set(self.culprits) - {self.case.culprit})

    @property
    def decided(self) -> bool:
        return self.culprits == [self.case.culprit]


def check(seed: int, folder: Path, *, big: bool = False) -> Outcome:
    case = make(seed, big=big)
    rng = random.Random(seed ^ 0x5EED)
    render(case, folder, rng)
    out = diagnose([str(folder)], layout=case.layout).as_json()
    return Outcome(case, out["culprits"], out["cause"])
