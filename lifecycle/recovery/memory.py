"""The in-memory checkpoint tier (``checkpoint.memory``): copies of every rank's state in node-local memory, each
replicated to a buddy rank on another node, restored by the next attempt after a failure.

At every ``memory.every_steps``-th step boundary each rank takes a copy of its state (the step handler's
``memory_state``: CPU tensors, on the training thread) after checking that every tensor is finite
(:mod:`lifecycle.recovery.state_check`). A background thread writes the copy into the node's folder
(:mod:`lifecycle.recovery.copies`), exchanges it with the buddy over a gloo group of the two (sizes first, then the
bytes) and, once every rank says both are written, drops the older copies; each wait bounded by the checkpoint
deadline. The next copy waits for the previous one.

Nothing here grows with the world size: the bytes go over pair groups made by their two members only
(:mod:`lifecycle.distributed.pairs`: one socket per pair, two pairs a rank), and what every rank must agree on — the
copies are written, the replicas' digests match, the lineage, the step to restore — goes through the store
(:mod:`lifecycle.distributed.agree`: a few calls and one barrier per rank), never a world collective.

At resume (every rank, before the persistent tier) the ranks agree on the newest step that **every** rank holds —
its own copy, or the one its buddy holds for it — checked against its record and digest and bound to this run's
world, layout, options and lineage; a rank whose own copy is gone receives it from its buddy. That step is used only
when it is not older than the persistent tier's tracker; every rank loads it and the ranks agree on the step each
loaded, or the persistent tier resumes as before. Steps are never mixed across ranks.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.checkpoint import binding, ckptdir
from lifecycle.distributed.agree import Agreements
from lifecycle.errors import CheckpointError
from lifecycle.recovery import copies as files
from lifecycle.recovery import rejections
from lifecycle.recovery.state_check import (
    Diverged,
    ReplicaPlan,
    ReplicaRows,
    first_nonfinite,
    refuse_nonfinite,
    replica_digests,
    replica_plan,
    replica_rows,
    replica_verdict,
)

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, Work

    from lifecycle.context import RunContext

log = logging.getLogger(__name__)

SLOTS = 4
"""Copies per rank and folder that take part in the agreement (``keep`` is at most 2)."""
REJECTED = 8
"""Rejected steps of the lineage rank 0 reads and sends (the newest: older ones are below any copy kept)."""
_COPY, _OWN, _HELD = 1, 2, 3
"""Message tags on the pair groups: a copy's bytes, the steps a rank owns, the steps it holds for its ward (with two
nodes the buddy and the ward are one rank, and both rows go to it)."""


def ranks_per_node(world: int) -> int:
    """The ranks of one node: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun, ``lifecycle run``), else SLURM's tasks
    per node, else every rank on one node."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit() and 0 < int(value) <= world and world % int(value) == 0:
            return int(value)
    return world


def buddy_of(rank: int, world: int, per_node: int) -> int:
    """The rank that holds ``rank``'s copies: the same local rank on the next node (the next rank with one node)."""
    shift = per_node if world > per_node else 1
    return (rank + shift) % world


def ward_of(rank: int, world: int, per_node: int) -> int:
    """The rank whose copies ``rank`` holds (the inverse of :func:`buddy_of`)."""
    shift = per_node if world > per_node else 1
    return (rank - shift) % world


def tier(ctx: RunContext) -> MemoryTier | None:
    """This round's tier, made at first use (None without ``checkpoint.memory.every_steps`` or a step handler). A
    step handler without ``memory_state`` and ``load_memory_state`` is a CheckpointError naming the kind."""
    if not ctx.policy.checkpoint.memory.every_steps or ctx.step_handler is None:
        return None
    if not isinstance(ctx.comms.memory, MemoryTier):
        handler = ctx.step_handler
        if not (callable(getattr(handler, "memory_state", None)) and callable(getattr(handler, "load_memory_state",
                                                                                      None))):
            raise CheckpointError(f"checkpoint.memory.every_steps is set, but train.kind {ctx.policy.train.kind} "
                                  f"({type(handler).__name__}) has no memory_state/load_memory_state: set "
                                  f"checkpoint.memory.every_steps=0", phase="train", rank=ctx.rank)
        ctx.comms.memory = MemoryTier.of(ctx)
    return ctx.comms.memory


def choose(owns: list[set[int]], helds: list[set[int]], per_node: int | None, tracked: int) -> int | None:
    """The step to restore: the newest that every rank holds — its own copy (``owns[rank]``) or, with buddies
    (``per_node``: ranks per node; None without replication), the copy its buddy holds for it (``helds[buddy]``) —
    when it is not older than the persistent tier's ``tracked`` step; else None. The rule with every rank's holdings
    in view: :meth:`MemoryTier.restore` reaches the same step with each rank's own and its buddy's holdings and a
    store agreement (tests/unit/distributed/test_agree.py holds the two equal)."""
    world = len(owns)

    def holds(rank: int) -> set[int]:
        return owns[rank] | (helds[buddy_of(rank, world, per_node)] if per_node is not None else set())

    common = set.intersection(*(holds(r) for r in range(world))) if world else set()
    best = max(common, default=None)
    return best if best is not None and best >= max(tracked, 1) else None


@dataclass
class Written:
    """What the background thread did with one copy (read on the training thread at the next wait)."""

    step: int
    bytes: int = 0
    held: int = 0
    write_s: float = 0.0
    error: str | None = None
    nonfinite: tuple[str, int] | None = None
    """The copy's first non-finite tensor and its count (the copy was then neither written nor sent)."""
    diverged: list[Diverged] = field(default_factory=list)
    """Replica groups of this rank whose digests disagreed (this rank among the odd ones: nothing written)."""
    checked: list[str] = field(default_factory=list)
    """The replica groups compared."""

    def refused(self, rank: int) -> bool:
        return self.nonfinite is not None or any(rank not in d.agree for d in self.diverged)


class _Copy:
    """One copy handed to the tier's thread: done once its write returned (or raised)."""

    def __init__(self, write: Callable[[], None]) -> None:
        self.write = write
        self.done = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)

    def is_alive(self) -> bool:
        return not self.done.is_set()


class _Writer:
    """The tier's background thread, one per round, started at the first copy: each later copy is a queue put on the
    training thread (starting a thread per copy made the training thread wait until the new one ran: ~2 ms a copy
    with four ranks on two cores). A daemon thread, not a ``ThreadPoolExecutor``: an executor's worker is joined at
    interpreter exit, and a copy stuck in a collective with a dead peer must not hold the process."""

    def __init__(self, rank: int) -> None:
        self.copies: queue.SimpleQueue[_Copy | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"lifecycle-memory-r{rank}", daemon=True)
        self.thread.start()

    def submit(self, write: Callable[[], None]) -> _Copy:
        copy = _Copy(write)
        self.copies.put(copy)
        return copy

    def _run(self) -> None:
        while (copy := self.copies.get()) is not None:
            try:
                copy.write()  # records its own outcome, errors included
            except Exception:  # noqa: BLE001 - one that escaped it: said; the next copy still runs
                log.exception("memory tier: a copy's write raised")
            finally:
                copy.done.set()

    def stop(self) -> None:
        """No more copies: the thread leaves once the one in flight is done."""
        self.copies.put(None)


@dataclass
class MemoryTier:
    """One rank's part of the tier for one round (an in-process restart makes a new one)."""

    base: Path
    rank: int
    world: int
    keep: int
    buddy: int | None
    ward: int | None
    bound: files.Bound | None = None
    rejected: set[int] = field(default_factory=set)
    """Steps rejected after an earlier restore (:mod:`lifecycle.recovery.rejections`): never restored again."""
    pairs: dict[int, ProcessGroup] = field(default_factory=dict)
    """The pair groups with the buddy and the ward, by their rank (one when they are the same rank)."""
    agree: Agreements | None = None
    """The training thread's agreements (start, restore), on the default group's store client."""
    agree_bg: Agreements | None = None
    """The writer thread's agreements, on a client of its own (a client serialises its calls)."""
    writer: _Writer | None = None
    in_flight: _Copy | None = None
    """The copy the writer's thread has not finished."""
    done: Written | None = None
    broken: str | None = None
    """Why copies stopped for this round (a failed exchange or agreement leaves the group unusable; the copies
    already written stay for the next round)."""

    @classmethod
    def of(cls, ctx: RunContext) -> MemoryTier:
        m = ctx.policy.checkpoint.memory
        per_node = ranks_per_node(ctx.world_size)
        pair = m.replicate and ctx.world_size > 1
        return cls(files.root(m.dir, ctx.policy.checkpoint.dir), ctx.rank, ctx.world_size, m.keep,
                   buddy_of(ctx.rank, ctx.world_size, per_node) if pair else None,
                   ward_of(ctx.rank, ctx.world_size, per_node) if pair else None)

    # ---- the pairs and the agreements ----------------------------------------------------------------------------
    def _connect(self, ctx: RunContext) -> bool:
        """The pair groups and the agreements (made once, on the training thread, at the same point on every rank:
        the tier's start). False where there is nobody to agree with (one rank, no process group)."""
        import torch.distributed as dist

        if self.agree is not None:
            return True
        if not dist.is_initialized() or self.world < 2:
            return False
        from lifecycle.distributed.pairs import make_pairs
        from lifecycle.watchdog.sidechannel import CLIENTS

        if self.buddy is not None:
            self.pairs = make_pairs(self.rank, self.world, ranks_per_node(self.world), ctx.deadline("checkpoint"))
        store = ctx.require_store()
        ranks = list(range(self.world))
        round_ = f"{ctx.attempt}/{ctx.comms.restart_round}"
        self.agree = Agreements(store, self.rank, ranks, f"memory/{round_}/main", phase="checkpoint", group="memory")
        with CLIENTS:  # one client made at a time in a process (see CLIENTS)
            own = store.clone()
        self.agree_bg = Agreements(own, self.rank, ranks, f"memory/{round_}/copies", phase="checkpoint", group="memory")
        return True

    def release_groups(self) -> list[ProcessGroup]:
        """The tier's process groups, forgotten here (teardown destroys them in a trainer's process)."""
        groups, self.pairs = list(dict.fromkeys(self.pairs.values())), {}
        return groups

    def _wait(self, works: Sequence[Work], what: str, ranks: list[int], deadline: float) -> None:
        from lifecycle.distributed.collectives import wait_works

        wait_works(works, what, "memory", ranks, deadline, time.monotonic())

    # ---- copies ------------------------------------------------------------------------------------------------
    def save(self, ctx: RunContext, step: int) -> None:
        """Take this rank's copy of ``step`` and hand it to the background thread (every rank, at the same step
        boundary: the exchange with the buddy pairs every rank). On the training thread only the copy itself (and
        the replicas' local digests where the handler cannot name the copy's tensors: ``replicas_in``); the checks
        (finite, replicas alike) run on the background thread, before anything is written, and a refused copy fails
        this rank at the next step boundary (:meth:`poll`)."""

        self.finish(ctx)
        ctx.drills.fire("checkpoint", step=step, op="memory")  # the copies of the last one are done
        take = getattr(ctx.require_step_handler(), "memory_state", None)
        if self.bound is None or not callable(take) or self.broken is not None:
            return
        ck = ctx.policy.checkpoint
        handler = ctx.require_step_handler()
        with ctx.events.span("memory_save", step=step):
            state = take(ctx)
            # the replicas' digests: of the copy, later on the background thread, where the handler names its
            # tensors there; of the live tensors, now, where it does not
            replicas = (replica_plan(ctx, handler, state) or replica_rows(ctx, handler)) if ck.check_replicas else None
        deadline = ctx.deadline("checkpoint")
        if self.writer is None:
            self.writer = _Writer(self.rank)
        self.in_flight = self.writer.submit(functools.partial(self._write, step, state, deadline,
                                                           ctx.progress.last_loss, ck.check_finite, replicas))

    def _write(self, step: int, state: object, deadline: float,
               loss: float | None = None, finite: bool = False,
               replicas: ReplicaPlan | ReplicaRows | None = None) -> None:
        """The background thread: the copy's checks, this rank's copy, the exchange with the buddies, then — once
        every rank says its copy and the one it holds are written — the older copies go. Until then they stay: a
        failure at any moment leaves the last step every rank completed. A refused copy (non-finite, or this rank's
        replica odd) is neither written nor sent, and the older copies stay everywhere; every rank still takes part
        in each collective."""
        import torch

        done = Written(step)
        t0 = time.perf_counter()
        own, held = files.own_dir(self.base, self.rank), None
        try:
            assert self.bound is not None
            done.nonfinite = first_nonfinite(state) if finite else None
            rows = replicas.rows() if isinstance(replicas, ReplicaPlan) else replicas
            if rows is not None and self.agree_bg is not None:
                done.diverged = self._compare(rows, self.agree_bg, step, deadline)
                done.checked = [name for name, ranks, _ in rows.groups if ranks]
            refused = done.refused(self.rank)
            blob = b""
            if not refused:
                buf = io.BytesIO()
                torch.save(state, buf)
                blob = buf.getvalue()
                done.bytes = files.write(own, step, self.rank, blob, self.bound, loss)
            if self.pairs and self.buddy is not None and self.ward is not None:
                got = self._exchange(blob, deadline)
                held = files.held_dir(self.base, self.ward)
                if got:  # an empty one: the ward refused its copy
                    done.held = files.write(held, step, self.ward, got, self.bound)
            if self._everyone_wrote(step, deadline, ok=not refused and not done.diverged):
                files.prune(own, self.keep)
                if held is not None:
                    files.prune(held, self.keep)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread at the next wait
            done.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        done.write_s = time.perf_counter() - t0
        self.done = done

    def _compare(self, rows: ReplicaRows, agree: Agreements, step: int, deadline: float) -> list[Diverged]:
        """This rank's replica groups whose digests disagree, through the store (:func:`replica_digests`)."""
        return replica_digests(agree, rows, f"replica digests of step {step}", deadline)

    def _everyone_wrote(self, step: int, deadline: float, ok: bool = True) -> bool:
        """Every rank wrote its copy (and the one it holds) and none refused it (``ok``): a store agreement
        (``ok`` alone with one rank)."""
        if self.agree_bg is None:
            return ok
        return self.agree_bg.all_true(f"memory copies of step {step} written", ok, deadline)

    def _exchange(self, blob: bytes, deadline: float) -> bytes:
        """Send ``blob`` to the buddy and receive the ward's (over the two pair groups)."""
        import torch
        import torch.distributed as dist

        assert self.buddy is not None and self.ward is not None
        to_buddy, from_ward = self.pairs[self.buddy], self.pairs[self.ward]
        size, got = torch.tensor([len(blob)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        works = [dist.isend(size, self.buddy, group=to_buddy, tag=_COPY),
                 dist.irecv(got, self.ward, group=from_ward, tag=_COPY)]
        self._wait(works, "memory copy sizes", [self.buddy, self.ward], deadline)
        works = []
        out = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else None  # alive until sent
        if out is not None:
            works.append(dist.isend(out, self.buddy, group=to_buddy, tag=_COPY))
        incoming = torch.empty(int(got.item()), dtype=torch.uint8)
        if incoming.numel():
            works.append(dist.irecv(incoming, self.ward, group=from_ward, tag=_COPY))
        self._wait(works, "memory copy bytes", [self.buddy, self.ward], deadline)
        return incoming.numpy().tobytes() if incoming.numel() else b""

    def finish(self, ctx: RunContext, timeout_s: float | None = None, *, verdict: bool = True) -> None:
        """Wait for the copy in flight (bounded by the checkpoint deadline) and record what became of it; with
        ``verdict`` a copy its checks refused fails this rank (:class:`~lifecycle.errors.BadState`: the odd replicas,
        a non-finite state), otherwise it is only logged."""
        copy, self.in_flight = self.in_flight, None
        if copy is None:
            return
        deadline = ctx.deadline("checkpoint") if timeout_s is None else timeout_s
        with ctx.events.span("memory_wait") as extra:
            copy.join(deadline)
            if copy.is_alive():
                self.broken = f"the copy in flight did not finish in {deadline:g}s"
                extra["error"] = self.broken
                log.error("memory tier: %s; no more copies this round", self.broken)
                return
        done, self.done = self.done, None
        if done is None:
            return
        ctx.events.instant("memory_saved", step=done.step, bytes=done.bytes, held=done.held,
                           write_s=round(done.write_s, 4), error=done.error, replicas=done.checked,
                           refused=done.refused(self.rank))
        if done.error is not None:
            self.broken = done.error
            log.error("memory copy of step %d: %s; no more copies this round", done.step, done.error)
            return
        if not verdict:
            if done.refused(self.rank) or done.diverged:
                log.error("memory copy of step %d was refused by its checks (%s)", done.step,
                          done.nonfinite or done.diverged)
            return
        refuse_nonfinite(ctx, done.nonfinite, done.step, "memory")
        for found in done.diverged:
            replica_verdict(ctx, found, done.step, "memory")

    def poll(self, ctx: RunContext) -> None:
        """At a step boundary: the verdict of a copy the writer has finished (a refused copy fails this rank
        here, with :class:`~lifecycle.errors.BadState`); nothing while it runs."""
        if self.in_flight is not None and not self.in_flight.is_alive():
            self.finish(ctx)

    # ---- start: the lineage, the restore -----------------------------------------------------------------------
    def start(self, ctx: RunContext) -> int:
        """Agree on the lineage (global rank 0's), bind this run's copies to it, remove copies bound to anything
        else; the persistent tracker's step as every rank read it (the largest). Every rank calls it, first: it makes
        the pair groups (their members, in a fixed order) and agrees through the store."""
        ck = ctx.policy.checkpoint
        lineage, tracked, rejected = 0, -1, []
        if ctx.rank == 0:
            lineage = files.lineage(ck.dir, new=ck.resume == "never")
            rejected = rejections.memory_steps(ck.dir, lineage)[:REJECTED]
        tracker = ckptdir.read_tracker(Path(ck.dir))
        if tracker.name is not None and tracker.error is None:
            tracked = ckptdir.step_of(tracker.name) or 0
        self.rejected = {int(s) for s in rejected}
        if self._connect(ctx):
            assert self.agree is not None
            deadline = ctx.deadline("checkpoint")
            given = self.agree.from_rank("memory lineage", 0, [lineage, rejected], deadline)
            assert isinstance(given, list)
            lineage, self.rejected = int(given[0]), {int(s) for s in given[1]}  # rank 0's reading of both
            tracked = self.agree.largest("tracked step", tracked + 1, deadline) - 1
        self.bound = files.Bound(self.world, binding.layout(ctx.policy, self.world, own_loop=ctx.own_loop),
                                 binding.options(ctx.policy, own_loop=ctx.own_loop), lineage)
        return tracked

    def _usable(self, folder: Path, owner: int) -> list[int]:
        """The steps of ``folder``'s copies of ``owner`` that can be used, newest first (checked: record, size,
        sha256); the others are removed."""
        assert self.bound is not None
        ok: list[int] = []
        for step in files.steps(folder):
            why = files.usable(folder, step, owner, self.bound, digest=True)
            if why is None and len(ok) < SLOTS:
                ok.append(step)
            else:
                log.warning("memory copy %s/step_%d not used: %s", folder, step, why or "more than kept")
                files.drop(folder, step)
        return ok

    def restore(self, ctx: RunContext, tracked: int) -> bool | None:
        """Resume from the newest step every rank holds, when it is not older than the tracker's ``tracked``:
        True when every rank loaded it; False when a load ran and failed on some rank (the state may be partly
        loaded: the persistent tier must load over it); None when no copy was used."""

        own = self._usable(files.own_dir(self.base, self.rank), self.rank)
        held = self._usable(files.held_dir(self.base, self.ward), self.ward) if self.ward is not None else []
        if self.rejected & set(own + held):
            log.warning("memory copies of steps %s not used: rejected after an earlier restore (%s)",
                        sorted(self.rejected & set(own + held)), Path(ctx.policy.checkpoint.dir) / rejections.NAME)
            own, held = [s for s in own if s not in self.rejected], [s for s in held if s not in self.rejected]
        deadline = ctx.deadline("checkpoint")
        held_for_me, ward_owns = self._swap_holdings(own, held, deadline)
        floor = max(tracked, 1)
        mine = {s for s in set(own) | held_for_me if s >= floor}  # what this rank can load: its own, or its buddy's
        best = self.agree.newest_common("memory copies", mine, deadline) if self.agree is not None else \
            max(mine, default=None)
        if best is None:
            if own or held:
                ctx.events.instant("memory_restore", used=False, tracked=tracked,
                                   why="no step every rank holds that is newer than the last commit")
            return None
        with ctx.events.span("memory_restore", step=best, tracked=tracked, deadline="checkpoint") as extra:
            blob = self._transfer(best, best in own, best in ward_owns, deadline)
            failed = self._load(ctx, blob, best)
            loaded = self.agree.all_true(f"memory restore of step {best}", not failed, deadline) \
                if self.agree is not None else not failed
            extra["moved"] = best not in own  # this rank's copy came from its buddy
            extra["failed"] = failed
            extra["everywhere"] = loaded
        if not loaded:
            log.warning("memory copy of step %d did not load on %s; resuming from the persistent tier", best,
                        "this rank" if failed else "some rank")
            return False
        ctx.progress.step = best
        ctx.progress.resumed_from = best
        ctx.progress.resumed_tier = "memory"
        assert self.bound is not None
        ctx.progress.restored = ("memory", rejections.memory_key(self.bound.lineage, best),
                                 files.saved_loss(files.own_dir(self.base, self.rank), best))
        if ctx.rank == 0:
            again = f"attempt {ctx.attempt}: " if ctx.attempt > 1 else ""
            last = f"step {tracked}" if tracked > 0 else "none"
            print(f"{again}resumed from step {best} (memory copies; last committed checkpoint: {last})", flush=True)
        return True

    def _swap_holdings(self, own: list[int], held: list[int], deadline: float) -> tuple[set[int], set[int]]:
        """Over the pairs: the steps the buddy holds for this rank, and the steps the ward holds of its own (each
        rank sends its own steps to its buddy and what it holds to its ward). Empty sets without buddies."""
        import torch
        import torch.distributed as dist

        if not self.pairs or self.buddy is None or self.ward is None:
            return set(), set()

        def row(steps: list[int]) -> torch.Tensor:
            out = torch.full((SLOTS,), -1, dtype=torch.int64)
            out[:len(steps[:SLOTS])] = torch.tensor(steps[:SLOTS], dtype=torch.int64)
            return out

        sent = [row(own), row(held)]
        from_buddy, from_ward = torch.zeros(SLOTS, dtype=torch.int64), torch.zeros(SLOTS, dtype=torch.int64)
        works = [dist.isend(sent[0], self.buddy, group=self.pairs[self.buddy], tag=_OWN),
                 dist.isend(sent[1], self.ward, group=self.pairs[self.ward], tag=_HELD),
                 dist.irecv(from_buddy, self.buddy, group=self.pairs[self.buddy], tag=_HELD),
                 dist.irecv(from_ward, self.ward, group=self.pairs[self.ward], tag=_OWN)]
        self._wait(works, "memory copies held", [self.buddy, self.ward], deadline)
        return {int(s) for s in from_buddy if s >= 0}, {int(s) for s in from_ward if s >= 0}

    def _transfer(self, step: int, have: bool, ward_has: bool, deadline: float) -> bytes | None:
        """This rank's copy of ``step``: its own (``have``), or sent by its buddy (who sends what it holds to a ward
        that lacks it: ``ward_has`` False)."""
        import torch
        import torch.distributed as dist

        mine = files.read(files.own_dir(self.base, self.rank), step) if have else None
        if not self.pairs or self.buddy is None or self.ward is None:
            return mine
        to_ward, from_buddy = self.pairs[self.ward], self.pairs[self.buddy]
        works: list[Work] = []
        keep: list[torch.Tensor] = []  # alive until the sends complete
        if not ward_has:  # my ward lost its copy: send it the one I hold
            data = files.read(files.held_dir(self.base, self.ward), step)
            keep += [torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(bytearray(data), dtype=torch.uint8)]
            works += [dist.isend(keep[0], self.ward, group=to_ward, tag=_COPY),
                      dist.isend(keep[1], self.ward, group=to_ward, tag=_COPY)]
        size = torch.zeros(1, dtype=torch.int64)
        if mine is None:
            self._wait([dist.irecv(size, self.buddy, group=from_buddy, tag=_COPY)], "memory restore size",
                       [self.buddy], deadline)
            incoming = torch.empty(int(size.item()), dtype=torch.uint8)
            works.append(dist.irecv(incoming, self.buddy, group=from_buddy, tag=_COPY))
        self._wait(works, "memory restore bytes", [self.buddy, self.ward], deadline)
        return incoming.numpy().tobytes() if mine is None else mine

    def _load(self, ctx: RunContext, blob: bytes | None, step: int) -> bool:
        """Load ``blob`` on this rank; whether it failed (logged)."""
        import torch


        try:
            if blob is None:
                raise ValueError("no copy")
            state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
            loaded = int(ctx.require_step_handler().load_memory_state(ctx, state))  # type: ignore[attr-defined]
            if loaded != step:
                raise ValueError(f"the copy holds step {loaded}, not {step}")
        except Exception as exc:  # noqa: BLE001 - agreed below, then the persistent tier
            log.error("memory copy of step %d does not load on rank %d: %s: %s", step, self.rank,
                      type(exc).__name__, str(exc)[:300])
            return True
        return False

    # ---- the end -----------------------------------------------------------------------------------------------
    def close(self, ctx: RunContext, *, finished: bool, wait_s: float | None = None) -> None:
        """Wait for a copy in flight (``wait_s``, else the checkpoint deadline); on a finished run remove this
        rank's copies: the run is over and the persistent tier holds what it saved."""
        if self.in_flight is not None:
            self.finish(ctx, timeout_s=wait_s, verdict=False)
        if self.writer is not None:
            self.writer.stop()
            self.writer = None
        if finished:
            files.remove_rank(self.base, self.rank, self.ward)
