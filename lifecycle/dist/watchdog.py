"""The watchdog: one thread per rank that turns a silent hang or a dead peer into a report and an exit.

It never uses a process group (a hung communicator cannot report on itself): progress goes through
the side channel (:mod:`lifecycle.dist.sidechannel`, its own TCPStore clients). The training thread
only updates a local slot (:class:`~lifecycle.dist.progress.Progress`, fed by the EventLog); the
watchdog thread publishes it every ``poll_interval_s`` with a heartbeat: O(1) store calls per rank
per poll, none per step on the training thread.

What it reacts to, at every poll:

1. a **deadline**: no begin/end event on this rank for ``watchdog.deadlines.<phase>`` seconds
   (``step`` in train: one step; ``warmup``: one op...). It wakes up exactly at the deadline;
2. the **alarm** key: another rank detected a hang, failed or saw a peer die;
3. the local launcher's **shutdown marker** (``run_dir/.shutdown``): a rank ended, the job is stopping;
4. a watched peer's **heartbeat** stopped for ``heartbeat_stale_s`` (ring neighbour and rank 0).

Then: one report on every rank (stderr, ``[rank N]``), ``hang_report.json`` from the lowest live rank,
all Python thread stacks into the rank log (faulthandler), a ``hang_report`` event, and the policy's
action. ``abort`` aborts the process groups and exits: with ``exit_codes.hang`` for a hang at once,
with ``exit_codes.rank_failed`` when a peer failed or died, after a short grace so that the failed rank
leaves first (the launcher then names it as the first failure). ``report`` only reports. In teardown
the hard deadline (``teardown.deadline_s``) owns the exit, so the watchdog only reports there.

The failure path calls :meth:`Watchdog.on_failure` so the same report appears when the training thread
itself hit a timeout or a broken connection, and so peers learn about this rank's failure at once.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any, NamedTuple

from lifecycle.dist import diagnosis
from lifecycle.dist.progress import Progress
from lifecycle.dist.sidechannel import SideChannel, connect
from lifecycle.errors import HangError, LifecycleError

log = logging.getLogger(__name__)
SHUTDOWN_MARKER = ".shutdown"  # written by lifecycle.launch before it SIGTERMs the ranks
FULL_VIEW_MAX = 1024  # above this world size a rank reads only the records it needs for its own line
_PEER_SIGNS = ("Connection closed by peer", "Connection reset", "Broken pipe", "communicator was aborted")


class Cause(NamedTuple):
    """Why a report is due: kind (hang|dead|failed|sequence), one line, the rank it started on."""

    kind: str
    detail: str
    origin: int | None
    phase: str | None
    dead: dict[int, str] = {}
    hint: list[int] = []

    @property
    def urgent(self) -> bool:
        return self.kind == "hang"


class Watchdog:
    """Per-rank watchdog. ``start()`` before the orchestrator runs, ``stop()`` when the run returns."""

    def __init__(self, ctx: Any) -> None:
        self.ctx, self.cfg = ctx, ctx.policy.watchdog
        self.rank, self.world = ctx.rank, ctx.world_size
        self.progress = Progress(ctx.rank, extra=self._extra)
        self.failing = False
        self.reported: diagnosis.Diagnosis | None = None
        self.grace_s = max(1.0, 2 * self.cfg.poll_interval_s)
        self._stop = threading.Event()
        self._report_lock = threading.Lock()
        self._main_lock = threading.Lock()
        self._channel: SideChannel | None = None
        self._main: SideChannel | None = None
        self._beats: dict[int, tuple[int, float]] = {}
        self._members: dict[str, list[int] | None] = {}
        self._thread = threading.Thread(target=self._run, name="lifecycle-watchdog", daemon=True)

    # ---- life cycle -------------------------------------------------------------------------
    def start(self) -> Watchdog:
        self.ctx.events.listeners.append(self.progress.on_event)
        self._thread.start()
        return self

    def stop(self) -> None:
        """The run returned: publish ``exited`` (peers must not take this rank for dead) and stop."""
        self.progress.set_state("exited" if not self.failing else "failed", self.progress.error)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.cfg.poll_interval_s + 2.0)
        if self.progress.on_event in self.ctx.events.listeners:
            self.ctx.events.listeners.remove(self.progress.on_event)

    def _run(self) -> None:
        try:
            store = connect(self.ctx.deadline("init"))
            if store is not None:
                self._channel = SideChannel(store, self.ctx.policy.run.id)
                self._main = self._channel.clone()
                self._channel.announce(self.rank, self.progress.record())
        except Exception as exc:  # noqa: BLE001 - deadlines are still watched locally
            log.warning("watchdog: no side channel (%s); peers will not be diagnosed", exc)
        while not self._stop.is_set():
            self._tick()
            self._stop.wait(self._sleep_s())
        self._safe(lambda ch: ch.publish(self.rank, self.progress.record()), self._channel)

    def _sleep_s(self) -> float:
        left = self.ctx.deadline(self.progress.phase) - self.progress.idle_s()
        return max(min(self.cfg.poll_interval_s, left), 0.01)

    def _tick(self) -> None:
        ch = self._channel
        self._safe(lambda c: (c.publish(self.rank, self.progress.record()), c.beat(self.rank)), ch)
        if self.failing or self.reported is not None:
            return
        cause = self._deadline() or self._safe(self._alarm, ch) or self._marker() or self._safe(self._peers, ch)
        if cause is not None:
            self.fire(cause, ch)

    def _safe(self, fn: Any, ch: SideChannel | None) -> Any:
        if ch is None:
            return None
        try:
            return fn(ch)
        except Exception as exc:  # noqa: BLE001 - a dead store must not kill the watchdog
            log.debug("watchdog store call failed: %s", exc)
            return None

    # ---- what triggers a report ---------------------------------------------------------------
    def _deadline(self) -> Cause | None:
        phase, idle = self.progress.phase, self.progress.idle_s()
        limit = self.ctx.deadline(phase)
        if idle < limit:
            return None
        op = self.progress.current()
        where = f" (at {op.name} on group {op.group}, op #{op.seq} there)" if op else ""
        return Cause("hang", f"rank {self.rank} made no progress for {idle:.1f}s{where}; the {phase} "
                     f"deadline is {limit:g}s", self.rank, phase)

    def _alarm(self, ch: SideChannel) -> Cause | None:
        info = ch.alarm()
        if info is None or info.get("rank") == self.rank:
            return None
        dead = {int(r): how for r, how in (info.get("dead") or {}).items()}
        return Cause(info["cause"], info["detail"], info.get("rank"), info.get("phase"), dead)

    def _marker(self) -> Cause | None:
        path = self.ctx.run_dir / SHUTDOWN_MARKER
        if not path.exists():
            return None
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            info = {}
        rank, how = info.get("rank"), info.get("how") or "ended"
        if rank is None:
            return Cause("dead", f"the launcher is stopping the job: {info.get('reason', '?')}", None, None)
        return Cause("dead", f"rank {rank} ended ({how}); the launcher is stopping the job", int(rank),
                     info.get("phase"), {int(rank): how})

    def _peers(self, ch: SideChannel) -> Cause | None:
        now = time.monotonic()
        for peer in {(self.rank + 1) % self.world, 0} - {self.rank}:
            count = ch.beats(peer)
            seen = self._beats.get(peer)
            if count == 0 or seen is None or seen[0] != count:
                self._beats[peer] = (count, now)
                continue
            if now - seen[1] > self.cfg.heartbeat_stale_s:
                rec = ch.record(peer)
                if rec is not None and rec.get("state") != "running":
                    self._beats[peer] = (count, float("inf"))  # it left (exited or failed): not dead
                    continue
                how = f"no heartbeat for {now - seen[1]:.1f}s"
                return Cause("dead", f"rank {peer} stopped sending heartbeats ({how}): dead or stopped", peer,
                             (rec or {}).get("phase"), {peer: how})
        return None

    # ---- report and act -----------------------------------------------------------------------
    def fire(self, cause: Cause, ch: SideChannel | None) -> None:
        """Report ``cause`` (once per rank) and run the policy action (watchdog thread)."""
        if cause.origin == self.rank:
            self._safe(lambda c: c.raise_alarm(self._alarm_info(cause)), ch)
        if self.report(cause, ch) is None or self.cfg.action != "abort":
            return
        if self.progress.phase == "teardown":
            return  # the hard deadline owns the exit in teardown
        if not cause.urgent and self._stop.wait(self.grace_s):
            return  # the run ended by itself during the grace
        if self.failing:
            return  # the failure path is running; teardown's hard deadline bounds it
        codes = self.ctx.policy.teardown.exit_codes
        self.progress.set_state("aborted", f"watchdog: {cause.kind}")
        self._safe(lambda c: c.publish(self.rank, self.progress.record()), ch)
        abort_and_exit(self.ctx, codes.hang if cause.urgent else codes.rank_failed)

    def _alarm_info(self, cause: Cause) -> dict[str, Any]:
        return {"rank": self.rank, "cause": cause.kind, "detail": cause.detail, "phase": cause.phase,
                "dead": {str(r): how for r, how in cause.dead.items()}, "t": time.time()}

    def report(self, cause: Cause, ch: SideChannel | None) -> diagnosis.Diagnosis | None:
        """Build, print and record the report; None if this rank already reported."""
        from lifecycle.dist.report import publish

        # Held while publishing: the other thread must not close the event log under a report.
        with self._report_lock:
            if self.reported is not None:
                return None
            d = self.reported = self._diagnose(cause, ch)
            publish(self.ctx, d, dump_stacks=cause.kind in ("hang", "dead"))
        return d

    def _diagnose(self, cause: Cause, ch: SideChannel | None) -> diagnosis.Diagnosis:
        records: dict[int, dict[str, Any] | None] = {}
        if ch is not None:
            try:
                records = ch.records(self._ranks_to_read(cause))
            except Exception as exc:  # noqa: BLE001 - report what this rank knows
                log.warning("watchdog: cannot read peer records: %s", exc)
        records[self.rank] = self.progress.record()
        dead = dict(cause.dead)
        marker = self._marker()
        if marker is not None:  # a rank that left through its own failure path or watchdog is not "dead"
            dead.update({r: how for r, how in marker.dead.items()
                         if (records.get(r) or {}).get("state", "running") == "running"})
        now = time.time()
        dead.update({r: how for r, how in diagnosis.stale_ranks(records, now, self.cfg.heartbeat_stale_s).items()
                     if r not in dead})
        return diagnosis.diagnose(cause.kind, cause.detail, records, self.world, dead=dead, origin=cause.origin,
                                  phase=cause.phase or self.progress.phase, hint=cause.hint, now=now)

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
        self.failing = True
        try:
            return self._on_failure(exc)
        except Exception as err:  # noqa: BLE001 - the original failure is what matters
            log.warning("watchdog: failure report failed: %s", err)
            return exc

    def _on_failure(self, exc: BaseException) -> BaseException:
        kind = classify(exc)
        text = f"{type(exc).__name__}: {exc}"[:600]
        phase = self.progress.phase
        self.progress.set_state("failed", text)
        with self._main_lock:
            ch = self._main
            self._safe(lambda c: c.publish(self.rank, self.progress.record()), ch)
            if kind in ("peer", "shutdown"):
                cause = self._origin(ch) or Cause("dead", text, None, phase)
            else:
                hint = list(getattr(exc, "missing", []) or [])
                detail = {"failed": f"rank {self.rank} raised {text}", "sequence": str(exc)}.get(
                    kind, f"rank {self.rank}: {text}")
                cause = Cause(kind, detail, self.rank, phase, {}, hint)
                self._safe(lambda c: c.raise_alarm(self._alarm_info(cause)), ch)
            d = self.report(cause, ch) or self.reported
        if kind == "hang" and not isinstance(exc, HangError) and d is not None:
            return HangError(f"{exc} [watchdog: stuck ranks {d.culprits}]", missing=d.culprits, phase=phase,
                             rank=self.rank)
        return exc

    def _origin(self, ch: SideChannel | None) -> Cause | None:
        """Who failed first (the alarm or the launcher's marker), waiting up to the grace for the news."""
        deadline = time.monotonic() + self.grace_s
        while True:
            cause = self._safe(self._alarm, ch) or self._marker()
            if cause is not None or time.monotonic() > deadline:
                return cause
            time.sleep(0.02)

    def peer_records(self, ranks: list[int]) -> dict[int, dict[str, Any] | None]:
        """The last published records of ``ranks`` (training thread; empty without a side channel)."""
        with self._main_lock:
            return self._safe(lambda c: c.records(ranks), self._main) or {}

    # ---- group members of the op in the record (watchdog thread) ------------------------------
    def _extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"ops": dict(self.ctx.op_counts), "sync": getattr(self.ctx._seq, "value", 0)}
        op = self.progress.current()
        if op is not None and op.ranks is None and op.group not in diagnosis.ALL_RANKS:
            extra["ranks"] = self._members_of(op.group)
        return extra

    def _members_of(self, label: str) -> list[int] | None:
        if label not in self._members:
            from lifecycle.dist.members import members_of

            self._members[label] = members_of(self.ctx, label)
        return self._members[label]


def classify(exc: BaseException) -> str:
    """hang | peer (a peer's connection broke) | shutdown (the launcher stops the job) | sequence | failed."""
    from lifecycle.dist.seqcheck import SequenceMismatch

    if isinstance(exc, HangError):
        return "hang"
    if isinstance(exc, SequenceMismatch):
        return "sequence"
    if type(exc).__name__ == "Shutdown":
        return "shutdown"
    text = f"{exc} {exc.__cause__ or ''}"
    if any(sign in text for sign in _PEER_SIGNS):
        return "peer"
    if not isinstance(exc, LifecycleError) and ("timed out" in text.lower() or type(exc).__name__ ==
                                                 "DistStoreError"):
        return "hang"
    return "failed"


def abort_and_exit(ctx: Any, code: int) -> None:
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
    ctx.events.instant("exit", exit_code=code, step=ctx.step, by="watchdog")
    ctx.events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
