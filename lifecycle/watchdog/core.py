"""The watchdog: one thread per rank that turns a silent hang or a dead peer into a report and an exit.

It never uses a process group (a hung communicator cannot report on itself): progress goes through
the side channel (:mod:`lifecycle.watchdog.sidechannel`, its own TCPStore clients). The training thread
only updates a local slot (:class:`~lifecycle.watchdog.tracker.ProgressTracker`, fed by the EventLog); the
watchdog thread publishes it every ``poll_interval_s`` with a heartbeat: O(1) store calls per rank
per poll, none per step on the training thread.

What it reacts to, at every poll:

1. a **deadline**: no begin/end event on this rank for ``watchdog.deadlines.<phase>`` seconds
   (``step`` in train: one step; ``warmup``: one op...). It wakes up exactly at the deadline;
2. the **alarm** key: another rank detected a hang, failed or saw a peer die;
3. the local launcher's **shutdown marker** (``run_dir/.shutdown``): a rank ended, the job is stopping;
4. a watched peer's **heartbeat** stopped for ``heartbeat_stale_s`` (ring neighbour and rank 0): it is frozen,
   cut off or dead without the launcher knowing — "unresponsive", reported at once with the hang code;
5. while this rank sits in one op: a member of that op's group blocked in an op this rank has not
   begun, while this rank's op is one that member has not begun: a collective-sequence divergence
   (a skipped or extra collective), named at once instead of at the deadline.

Then: one report on every rank (stderr, ``[rank N]``), ``hang_report.json`` from the lowest live rank,
all Python thread stacks into ``logs/rank_<R>.stacks.txt`` (faulthandler), a ``hang_report`` event, and the policy's
action. ``abort`` aborts the process groups and exits at once with ``exit_codes.hang`` for a hang
(a collective divergence too: the job would hang at that collective); when a peer failed or died it exits with ``exit_codes.rank_failed``
after a short grace, so that the failed rank leaves first (the launcher then names it as the first
failure) and the training thread may still leave through the failure path. ``report`` only reports. A
hang in teardown is only reported: the hard deadline (``teardown.deadline_s``) owns that exit.

The failure path calls :meth:`Watchdog.on_failure` so the same report appears when the training thread
itself hit a timeout or a broken connection, and so peers learn about this rank's failure at once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, TypeVar

import lifecycle.rundir as rundir
from lifecycle.errors import ExitCode, HangError, PeerFailed, PeerLeftAfterHang, StoreUnavailable, culprits
from lifecycle.jsontypes import JsonDict
from lifecycle.watchdog import causes, diagnosis
from lifecycle.watchdog.bounded import BoundedChannel
from lifecycle.watchdog.causes import Cause
from lifecycle.watchdog.members import members_of
from lifecycle.watchdog.report import publish, publish_local, publish_usage
from lifecycle.watchdog.sidechannel import SideChannel, answers, connect, store_address
from lifecycle.watchdog.straggler import StragglerDetector
from lifecycle.watchdog.tracker import ProgressTracker

if TYPE_CHECKING:
    from lifecycle.watchdog.run import WatchedRun

log = logging.getLogger(__name__)
T = TypeVar("T")
Refusal = Callable[["WatchedRun", "str | None", str], "str | None"]
"""Why a failure of a cause in a phase cannot be restarted in place (:func:`lifecycle.recovery.inprocess.refusal`)."""
CONNECT_ATTEMPT_S = 1.0  # one attempt of the side channel's connect (retried until the init deadline)
CONNECT_VALIDATE_S = 10.0
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"  # "True": the launcher hosts the store (torchrun, lifecycle run)
"""The client's handshake once the port answers: on an overloaded node (ten SLURM jobs' ranks importing torch on two
CPUs) a store took over 3 s, and a timed-out handshake is torch's C++ error line and stack in the rank's log."""
STRAGGLER_EVERY_S = 1.0  # rank 0 compares the compute medians at most this often
VIEW_RANKS_PER_S = 64
"""Records rank 0's straggler view reads per second at most: the view reads every rank's record (about 30 ms of
rank 0's CPU at 1,024 ranks, bench/scale.py), so it comes every world / 64 s above 64 ranks, and rank 0's CPU per
poll stays flat in the world size."""


def straggler_every_s(world: int) -> float:
    """How often rank 0 reads every record for the straggler view at ``world`` ranks."""
    return max(STRAGGLER_EVERY_S, world / VIEW_RANKS_PER_S)
FRESHEN_MAX = 64  # dead or silent ranks whose events file is read to freshen their record
FRESH_POLLS = 1.5  # a report waits at most this many polls for the running peers' records published after it
FULL_VIEW_MAX = 1024  # above this world size a rank reads only the records it needs for its own line


class Watchdog:
    """Per-rank watchdog. ``start()`` before the orchestrator runs, ``stop()`` when the run returns."""

    def __init__(self, ctx: WatchedRun, *, refusal: Refusal | None = None) -> None:
        """``refusal(ctx, phase, cause)``: why a failure cannot be restarted in place (None: it can); without one
        this rank never asks for a restart in place."""
        self.ctx, self.cfg = ctx, ctx.policy.watchdog
        self._refusal = refusal
        self.rank, self.world = ctx.rank, ctx.world_size
        self.progress = ProgressTracker(ctx.rank, extra=self._extra, members=lambda label: members_of(ctx, label))
        self.failing = False
        self.reported: diagnosis.Diagnosis | None = None
        self.restart_request: Cause | None = None
        self.grace_s = max(1.0, 2 * self.cfg.poll_interval_s)
        self._stop = threading.Event()
        self._poke = threading.Event()  # look now: a signal came (the launcher's marker may be there), or stop
        self.quick = _own_launcher()
        """Started by `lifecycle run`, whose launcher writes its marker, signals the ranks and gives them a grace: a
        failure's reports do not wait a fixed half poll, and a signal wakes the watchdog. Under torchrun or srun
        their agent takes the group down as the first rank leaves (SIGTERM, which a trainer's own exit path may not
        survive once lifecycle has left): there the reports keep their half-poll wait."""
        self._report_lock = threading.Lock()
        self._restart_lock = threading.Lock()
        self._main_lock = threading.Lock()
        # Two store clients, each on its own I/O thread: the watchdog thread's and the failure path's. A call on
        # a dead connection blocks only that I/O thread, never the thread that must act.
        op_timeout = max(1.0, 2 * self.cfg.poll_interval_s)
        self.store_address = store_address()
        self._io: BoundedChannel[SideChannel] = BoundedChannel(
            self._connect, op_timeout_s=op_timeout, name="lifecycle-watchdog-io", address=self.store_address,
            start=False)
        self._io_main: BoundedChannel[SideChannel] = BoundedChannel(
            self._connect, op_timeout_s=op_timeout, name="lifecycle-failure-io", address=self.store_address,
            start=False)
        self._premade: list[SideChannel] = []
        """Clients made on the training thread before the I/O threads start (:meth:`_preconnect`)."""
        self._announced = False
        self._beats = causes.Heartbeats(self.rank, self.world, self.cfg.heartbeat_stale_s)
        straggler = self.cfg.straggler
        self._stragglers = (StragglerDetector(straggler) if self.rank == 0 and straggler.action == "report"
                            and 1 < self.world <= FULL_VIEW_MAX else None)
        self._next_straggler_check = 0.0
        self._next_probe = 0.0
        self._thread = threading.Thread(target=self._run, name="lifecycle-watchdog", daemon=True)

    # ---- life cycle -------------------------------------------------------------------------
    def start(self) -> Watchdog:
        # Import torch.distributed here, on the training thread: two threads importing torch modules at
        # once can deadlock or abort (pybind "type already defined"); the watchdog thread imports nothing.
        import torch.distributed  # noqa: F401

        self.ctx.events.listeners.append(self.progress.on_event)
        self._preconnect()
        self._io.start()
        self._io_main.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """The run returned: publish ``exited`` (peers must not take this rank for dead) and stop."""
        self.progress.set_state("exited" if not self.failing else "failed", self.progress.error)
        self._stop.set()
        self._poke.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.cfg.poll_interval_s + 2.0)
        for io in (self._io, self._io_main):  # let a connect attempt or a last call finish (bounded)
            io.close(join_s=CONNECT_ATTEMPT_S + 0.5)
        if self.progress.on_event in self.ctx.events.listeners:
            self.ctx.events.listeners.remove(self.progress.on_event)

    def _preconnect(self) -> None:
        """Under a launcher that hosts the store (``lifecycle run``, torchrun: it answers before the rank starts),
        the two clients are made here, on the training thread, one after the other and before ``init_process_group``
        makes torch's: no two clients are made at once in a freshly forked rank (``sidechannel.CLIENTS``). Each
        attempt is bounded (``CONNECT_ATTEMPT_S``); where one fails, the I/O threads connect as before."""
        if os.environ.get(AGENT_STORE) != "True" or not answers(CONNECT_ATTEMPT_S):
            return
        for _ in (self._io, self._io_main):
            try:
                store = connect(CONNECT_ATTEMPT_S)
            except Exception:  # noqa: BLE001 - the I/O thread connects then, with its retries
                return
            if store is None:
                return
            self._premade.append(SideChannel(store, self.ctx.policy.run.id, self.ctx.comms.restart_round))

    def _connect(self) -> SideChannel | None:
        """Runs on an I/O thread, in short attempts until the init deadline (or until the watchdog stops): a
        thread must never sit in a long C++ call when the interpreter exits. A client made by :meth:`_preconnect`
        is taken first."""
        try:
            return self._premade.pop()
        except IndexError:
            pass
        deadline = time.monotonic() + self.ctx.deadlines.deadline("init")
        while not self._stop.is_set():
            attempt_s = min(CONNECT_ATTEMPT_S, max(deadline - time.monotonic(), 0.1))
            if not answers(attempt_s):  # not up or not answering yet: retry quietly
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the rendezvous store at {store_address()} did not answer")
                self._stop.wait(0.1)
                continue
            try:  # the port answers: the handshake gets longer than a probe (its timeout is torch's C++ error line)
                store = connect(min(CONNECT_VALIDATE_S, max(deadline - time.monotonic(), attempt_s)))
            except Exception:  # noqa: BLE001 - not up yet (rank 0 creates it inside init under mp.spawn)
                if time.monotonic() >= deadline:
                    raise
                continue
            return None if store is None else SideChannel(store, self.ctx.policy.run.id, self.ctx.comms.restart_round)
        return None

    def wake(self) -> None:
        """Look now instead of at the next poll (any thread; a signal handler's thread): the local launcher
        writes its marker before it signals the ranks, and a rank whose main thread sits in a collective that a
        dead peer broke elsewhere learns of it here at once, not a poll later. Under `lifecycle run` only
        (:attr:`quick`)."""
        if self.quick:
            self._poke.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poke.clear()  # before the look: a wake during it makes the next wait return at once
            self._tick()
            self._poke.wait(self._sleep_s())
        self._safe(lambda ch: ch.publish(self.rank, self.progress.record()), self._io)

    def _sleep_s(self) -> float:
        """Until the next poll, or exactly until this rank's deadline passes if that comes first."""
        if self.reported is not None or self.failing:
            return self.cfg.poll_interval_s  # only heartbeats from now on
        left = self.ctx.deadlines.deadline(self.progress.bound()) - self.progress.idle_s()
        return max(min(self.cfg.poll_interval_s, left), 0.01)

    def _tick(self) -> None:
        # The local checks first: they touch no network and can never be delayed by a dead store.
        if self.failing or self.reported is not None:
            self._safe(self._publish_and_beat, self._io)
            return
        bound = self.progress.bound()
        derivation = self.ctx.deadlines.derivation(bound)
        cause = (causes.deadline_passed(self.progress, self.ctx.deadlines.deadline(bound), self.rank, bound=bound,
                                        how=derivation.text if derivation is not None else None)
                 or causes.from_marker(self.ctx.run_dir) or self._lost())
        io = self._io
        if cause is not None and cause.kind == "dead":
            # A rank that ended is often the consequence of the first failure (its watchdog raised the alarm, then
            # left): the alarm's cause is the job's one verdict, and every rank reports it.
            cause = self._safe(lambda c: causes.from_alarm(c, self.rank), io) or cause
        if cause is None:
            self._safe(self._publish_and_beat, io)
            cause = (self._safe(lambda c: causes.from_alarm(c, self.rank), io)
                     or self._safe(self._beats.check, io) or self._safe(self._crossed, io))
        if cause is not None:
            if not cause.urgent and self.quick:  # where this rank waits now: the peers' failure reports wait for it
                self._safe(self._publish_and_beat, io)
            self.fire(cause, self._io)
        elif self._stragglers is not None and time.monotonic() >= self._next_straggler_check:
            self._next_straggler_check = time.monotonic() + straggler_every_s(self.world)
            self._check_stragglers()

    def _check_stragglers(self) -> None:
        """Rank 0: one multi_get of every record, compare the published compute medians (the job goes on)."""
        assert self._stragglers is not None
        world = list(range(self.world))
        records = self._safe(lambda c: c.records(world), self._io)
        if not records:
            return
        for finding in self._stragglers.check(records):
            log.warning("%s", finding.line())
            self.ctx.events.instant("straggler", straggler_rank=finding.rank, ratio=round(finding.ratio, 3),
                                    compute_s=finding.compute_s, median_s=finding.median_s, window=finding.window,
                                    at_step=finding.step, recovered=finding.recovered or None, line=finding.line())

    def _publish_and_beat(self, ch: SideChannel) -> int:
        if not self._announced:
            ch.announce(self.rank, self.progress.record())
            self._announced = True
        ch.publish(self.rank, self.progress.record())
        return ch.beat(self.rank)

    def _lost(self) -> Cause | None:
        """The store has not answered for ``heartbeat_stale_s``: this rank is cut off from its peers."""
        down = self._io.down_for()
        if down <= self.cfg.heartbeat_stale_s:
            return None
        since = time.strftime("%H:%M:%S", time.gmtime(self._io.down_since_wall or time.time()))
        own = diagnosis.where(self.progress.record(), time.time())
        return Cause("lost", f"side channel lost: store {self.store_address} unreachable since {since} UTC "
                     f"({down:.1f}s; {self._io.last_error}); rank {self.rank} was at {own}", self.rank,
                     self.progress.phase)

    def _crossed(self, ch: SideChannel) -> Cause | None:
        # Only while this rank sits in one op for two polls, then every four: O(1) store calls otherwise.
        poll = self.cfg.poll_interval_s
        if self.progress.idle_s() < 2 * poll or time.monotonic() < self._next_probe:
            return None
        self._next_probe = time.monotonic() + 4 * poll
        return causes.crossed_wait(self.progress, ch, self.rank, self.world)

    def _safe(self, fn: Callable[[SideChannel], T], io: BoundedChannel[SideChannel]) -> T | None:
        """``fn(channel)`` on ``io``'s thread, bounded; None when the store does not answer in time."""
        try:
            return io.call(fn)
        except StoreUnavailable as exc:
            log.debug("watchdog store call failed: %s", exc)
            return None

    # ---- report and act -----------------------------------------------------------------------
    def fire(self, cause: Cause, ch: BoundedChannel[SideChannel]) -> None:
        """Report ``cause`` (once per rank) and run the policy action (watchdog thread)."""
        if cause.origin == self.rank:
            self._safe(lambda c: c.raise_alarm(cause.alarm(self.rank)), ch)
        if self.report(cause, ch) is None or self.cfg.action != "abort":
            return
        if cause.kind in ("hang", "unresponsive") and self.progress.phase == "teardown":
            return  # a hang in teardown: its hard deadline (teardown.deadline_s) owns the exit
        if not cause.urgent and self._stop.wait(self.grace_s):
            return  # the run ended by itself during the grace
        if self.failing:
            return  # the failure path is running; teardown's hard deadline bounds it
        if self._restart_in_place(cause):
            return  # the training thread left its phase: it restarts in place (or leaves through its failure path)
        codes = self.ctx.policy.teardown.exit_codes
        self.progress.set_state("aborted", f"watchdog: {cause.kind}")
        self._safe(lambda c: c.publish(self.rank, self.progress.record()), ch)
        # a collective divergence hangs the job at its next collective: it gets the hang code, named early
        # and so does a peer that stopped answering without exiting (frozen, or cut off by the network): from
        # here that is a hang, whichever of the watchdog or a collective's timeout sees it first
        code = {"hang": codes.hang, "lost": codes.hang, "sequence": codes.hang, "unresponsive": codes.hang,
                "usage": ExitCode.USAGE}.get(cause.kind, codes.rank_failed)
        from lifecycle.rundir.elastic import record_failure

        d = self.reported
        record_failure(rank=self.rank, error=f"watchdog: {diagnosis.CAUSES.get(cause.kind, cause.kind)}",
                       message=cause.detail, exit_code=code, phase=cause.phase or self.progress.phase,
                       ranks=d.culprits if d is not None else None,
                       detail=f"the report: {self.ctx.run_dir}; every rank's stderr has its own view")
        abort_and_exit(self.ctx, code)

    def _restart_in_place(self, cause: Cause) -> bool:
        """``restart.mode: in_process`` and a failure the processes survive: ask the training thread to leave its
        phase (:class:`~lifecycle.errors.RestartRequested` at its next step boundary, or a collective that breaks
        when the failed rank's groups go) and wait for it up to ``restart.in_process_deadline_s``. True when it
        left; False when it did not (a collective that cannot be given up): the policy's action follows."""
        restart = self.ctx.policy.restart
        if restart.mode != "in_process" or not restart.max_restarts or self._refusal is None or \
                self._refusal(self.ctx, self.progress.phase, cause.kind) is not None:
            return False
        from lifecycle.distributed.sockets import cut_connections, store_port

        with self._restart_lock:  # never after the training thread began its restart: the new groups' connections
            if self.failing:
                return True
            self.restart_request = cause
            # The training thread may sit in a collective that waits on the failed rank or on another rank that
            # does: give it up (gloo cannot abort one) so that it leaves its phase now, not at its deadline.
            cut = cut_connections(store_port())
        log.warning("restarting in place after %s: %d connection(s) of this rank's process groups shut down",
                    cause.detail, cut)
        end = time.monotonic() + restart.in_process_deadline_s
        while not self.failing and time.monotonic() < end:
            if self._stop.wait(0.05):
                return True
        if self.failing:
            return True
        where = diagnosis.where(self.progress.record(), time.time())
        print(f"[rank {self.rank}] restart in place not possible: this rank did not leave {where} within "
              f"{restart.in_process_deadline_s:g}s (a collective that cannot be given up); leaving for a relaunch",
              file=sys.stderr, flush=True)
        return False

    def report(self, cause: Cause, ch: BoundedChannel[SideChannel]) -> diagnosis.Diagnosis | None:
        """Build, print and record the report; None if this rank already reported.

        A configuration error (a bad policy, environment or checkpoint) is not a hang: one line, no diagnosis
        of who is stuck, no hang_report.json, no stacks.
        """
        # Held while publishing: the other thread must not close the event log under a report.
        with self._report_lock:
            if self.reported is not None:
                return None
            if cause.kind == "usage":
                d = self.reported = diagnosis.Diagnosis(cause.kind, cause.detail, cause.origin, cause.phase,
                                                        culprits=[] if cause.origin is None else [cause.origin])
                publish_usage(self.ctx, d)
                return d
            if cause.kind == "lost":  # nobody else can be asked: report this rank's own view, locally
                records: dict[int, JsonDict | None] = {self.rank: self.progress.record()}
                d = self.reported = diagnosis.Diagnosis(
                    cause.kind, cause.detail, self.rank, cause.phase, records=records, now=time.time(),
                    unreachable=f"the store {self.store_address} does not answer ({ch.last_error or 'lost'})")
                publish_local(self.ctx, d)
                return d
            d = self.reported = self._diagnose(cause, ch)
            publish(self.ctx, d, dump_stacks=cause.kind in ("hang", "dead", "unresponsive"))
        return d

    def _diagnose(self, cause: Cause, ch: BoundedChannel[SideChannel]) -> diagnosis.Diagnosis:
        half = min(self.cfg.poll_interval_s, 0.5)
        if not cause.urgent and cause.kind != "hang" and not self.quick:
            # Under torchrun or srun: peers that still move publish once per poll; give them half of one to show
            # where the failure found them (a failed or dead rank is the culprit whatever they show).
            time.sleep(half)
        wanted = self._ranks_to_read(cause)
        ch.wait_connected(ch.op_timeout_s)  # a report early in the run may come while the client still connects
        read = self._safe(lambda c: c.records(wanted), ch)

        def again(ranks: list[int]) -> dict[int, JsonDict | None] | None:
            return self._safe(lambda c: c.records(ranks), ch)

        marker = causes.from_marker(self.ctx.run_dir)  # written once by the launcher; read again below if not yet there
        if read is not None and not cause.urgent and cause.kind == "hang":
            # a hang's culprits are read from where the others wait: every running peer's record after the stall
            read = fresh_records(read, again, self.rank, self.cfg.poll_interval_s)
        elif read is not None and not cause.urgent and cause.origin != self.rank and self.quick:
            # A failed or dead rank is the culprit whatever the others show; they show where the failure found
            # them once they publish after it (each does at once on its own failure path, a peer that still moves
            # within a poll, or at once when a signal wakes its watchdog): up to half a poll for those, never a
            # fixed wait on the way to the relaunch. Dead ranks are not waited for, nor by the rank that failed: its
            # peers learn of it as it leaves, and report their own view.
            gone = {cause.origin, *cause.dead, *(marker.dead if marker is not None else ())}
            since = cause.t or (marker.t if marker is not None else None)
            read = fresh_records(read, again, self.rank, self.cfg.poll_interval_s, bound_s=half, every_s=0.02,
                                 skip=gone, since=since)
        records: dict[int, JsonDict | None] = read or {}
        unreachable = None
        if read is None and not ch.absent:
            why = ch.last_error if ch.connected else "its client is still connecting"
            unreachable = f"the store {self.store_address} does not answer ({why})"
        records[self.rank] = self.progress.record()
        dead = dict(cause.dead)
        marker = marker or causes.from_marker(self.ctx.run_dir)
        if marker is not None:  # a rank that left through its own failure path or watchdog is not "dead"
            dead.update({r: how for r, how in marker.dead.items()
                         if (records.get(r) or {}).get("state", "running") == "running"})
        now = time.time()
        dead.update({r: how for r, how in diagnosis.stale_ranks(records, now, self.cfg.heartbeat_stale_s).items()
                     if r not in dead})
        self._freshen(records, sorted(set(dead) | {r for r, rec in records.items() if rec is None}))
        return diagnosis.diagnose(cause.kind, cause.detail, records, self.world, dead=dead, origin=cause.origin,
                                  phase=cause.phase or self.progress.phase, hint=cause.hint, now=now,
                                  unreachable=unreachable)

    def _freshen(self, records: dict[int, JsonDict | None], ranks: list[int]) -> None:
        """A dead rank's last flushed event may be newer than its last published record (it died between two
        polls): where the events file is readable here, the newer of the two describes the rank."""
        for r in ranks[:FRESHEN_MAX]:
            if r == self.rank:
                continue
            event = rundir.last_event(self.ctx.run_dir, r)
            if not event or not isinstance(event.get("t"), int | float):
                continue
            t = float(event["t"]) / 1e6
            rec = records.get(r)
            if rec is not None and t <= float(rec.get("t", 0.0)):
                continue
            fresh: JsonDict = dict(rec or {"rank": r, "state": "running", "begun": {}})
            fresh.update(phase=event.get("phase"), step=event.get("step"), t=t, idle_s=0.0, op=None,
                         last=None, from_events=f"{event.get('kind')} {event.get('name')}")
            records[r] = fresh

    def _ranks_to_read(self, cause: Cause) -> list[int]:
        if self.world <= FULL_VIEW_MAX:
            return list(range(self.world))
        op = self.progress.current()
        mine = (op.ranks or []) if op else []
        named = {cause.origin} if cause.origin is not None else set()
        return sorted(set(mine[:256]) | set(cause.dead) | {0, self.rank} | named)

    # ---- the failure path (training thread) ---------------------------------------------------
    def on_failure(self, exc: BaseException) -> BaseException:
        """The orchestrator is taking the failure edge: tell peers, report, return the error to raise.

        A torch timeout becomes a :class:`HangError` naming the stuck ranks (exit code ``hang``).
        """
        with self._restart_lock:
            self.failing = True
        try:
            return self._on_failure(exc)
        except Exception as err:  # noqa: BLE001 - the original failure is what matters
            log.warning("watchdog: failure report failed: %s", err)
            return exc

    def _on_failure(self, exc: BaseException) -> BaseException:
        kind = causes.classify(exc)
        text = f"{type(exc).__name__}: {exc}"[:600]
        phase = self.progress.phase
        self.progress.set_state("failed", text)
        with self._main_lock:
            ch = self._io_main
            self._safe(lambda c: c.publish(self.rank, self.progress.record()), ch)
            if kind in ("peer", "shutdown"):
                cause = self._origin(ch) or Cause("dead", text, None, phase)
            elif kind == "lost":
                own = diagnosis.where(self.progress.record(), time.time())
                cause = Cause("lost", f"side channel lost: store {self.store_address} unreachable ({text}); rank "
                              f"{self.rank} was at {own}", self.rank, phase)
            else:
                hint = culprits(exc)
                detail = {"failed": f"rank {self.rank} raised {text}", "sequence": str(exc)}.get(
                    kind, f"rank {self.rank}: {text}")
                cause = Cause(kind, detail, self.rank, phase, {}, hint)
                self._safe(lambda c: c.raise_alarm(cause.alarm(self.rank)), ch)
            d = self.report(cause, ch) or self.reported
        if kind == "lost":
            return HangError(cause.detail, phase=phase, rank=self.rank, group="store")
        if kind == "hang" and not isinstance(exc, HangError) and d is not None:
            return HangError(f"{exc} [watchdog: stuck ranks {d.culprits}]", missing=d.culprits, phase=phase,
                             rank=self.rank)
        hung = ("hang", "unresponsive", "sequence")
        if kind == "peer" and d is not None and (cause.kind in hung or d.cause in hung):
            # A peer left after a hang was reported: the connection it closed is the hang's consequence, and this
            # rank exits with the hang code like the rest, whichever reached it first.
            return PeerLeftAfterHang(f"{exc} [watchdog: {d.cause} reported by rank {d.origin}; stuck ranks "
                                     f"{d.culprits}]", missing=d.culprits, phase=phase, rank=self.rank)
        if kind == "peer" and d is not None and d.cause in ("failed", "dead") and d.culprits:
            first = f"rank {d.culprits[0]}" if len(d.culprits) == 1 else f"ranks {d.culprits}"
            return PeerFailed(f"{first} failed first ({d.detail[:300]}); this rank's collective broke as a "
                              f"consequence: {' '.join(str(exc).split())[:200]}", phase=phase, rank=self.rank)
        return exc

    def _origin(self, ch: BoundedChannel[SideChannel]) -> Cause | None:
        """Who failed first (the alarm or the launcher's marker), waiting up to the grace for the news."""
        deadline = time.monotonic() + self.grace_s
        while True:
            cause = self._safe(lambda c: causes.from_alarm(c, self.rank), ch) or causes.from_marker(self.ctx.run_dir)
            if cause is not None or time.monotonic() > deadline:
                return cause
            time.sleep(0.02)

    def peer_records(self, ranks: list[int]) -> dict[int, JsonDict | None]:
        """The last published records of ``ranks`` (training thread; empty without a side channel)."""
        with self._main_lock:
            return self._safe(lambda c: c.records(ranks), self._io_main) or {}

    # ---- fields the record takes from the run context (watchdog thread) -----------------------
    def _extra(self) -> JsonDict:
        ops, keys = self.ctx.ops.snapshot()
        extra: JsonDict = {"ops": ops, "sync": keys}
        if self.ctx.compute is not None:
            extra.update(self.ctx.compute.fields())
        return extra


def fresh_records(first: dict[int, JsonDict | None], read: Callable[[list[int]], dict[int, JsonDict | None] | None],
                  me: int, poll_s: float, *, bound_s: float | None = None, every_s: float | None = None,
                  skip: Collection[int | None] = (), since: float | None = None) -> dict[int, JsonDict | None]:
    """The records as published after a cause reached rank ``me``: each running peer publishes once per poll, and
    a record written before the stall was seen (a peer shown in the op before the one it now waits in) would name
    the wrong rank or nobody. ``read`` is re-called for the peers still to publish (every ``every_s``, a quarter
    poll by default) until each has, at most ``bound_s`` (``FRESH_POLLS`` polls); a peer that does not (frozen,
    cut off) keeps its last record — its age says so. Ranks in ``skip`` (dead ones) are not waited for, nor those
    whose first record was published at ``since`` (when the failure became known) or later. ``read`` returning None
    (the store does not answer) ends the wait."""
    seen = {r: rec.get("t") for r, rec in first.items()
            if r != me and r not in skip and rec is not None and rec.get("state") == "running"
            and not (since is not None and isinstance(rec.get("t"), int | float) and rec["t"] >= since)}
    records = dict(first)
    end = time.monotonic() + (FRESH_POLLS * poll_s if bound_s is None else bound_s)
    while seen and time.monotonic() < end:
        time.sleep(poll_s / 4 if every_s is None else every_s)
        again = read(sorted(seen))
        if again is None:
            break
        for r, rec in again.items():
            if rec is not None:
                records[r] = rec
                if rec.get("t") != seen.get(r) or rec.get("state") != "running":
                    seen.pop(r, None)
    return records


def _own_launcher() -> bool:
    """This rank was started by ``lifecycle run`` (its launcher writes the shutdown marker, then signals the ranks
    and waits a grace for them), not by torchrun or srun: only that launcher gives its ranks ``rundir.ENV_LAUNCHED``."""
    return bool(os.environ.get(rundir.ENV_LAUNCHED))


def abort_and_exit(ctx: WatchedRun, code: int, *, by: str = "watchdog") -> None:
    """Abort every process group (bounded: a helper thread, 2 s), close the event log and leave."""
    def abort() -> None:
        try:
            import torch.distributed.distributed_c10d as c10d

            if c10d.is_initialized() and hasattr(c10d, "_abort_process_group"):
                c10d._abort_process_group()
        except Exception as exc:  # noqa: BLE001 - not every backend can abort
            log.debug("abort: %s", exc)

    helper = threading.Thread(target=abort, name="lifecycle-abort", daemon=True)
    helper.start()
    helper.join(2.0)
    ctx.events.instant("exit", exit_code=code, step=ctx.step, by=by)
    ctx.events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
