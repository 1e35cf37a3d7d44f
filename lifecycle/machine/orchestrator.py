"""The state machine that runs a policy on one rank.

The phases run in the order of :data:`lifecycle.machine.graph.MAIN_PATH` (init -> warmup -> train ->
teardown; a phase the policy disables is skipped), the train phase takes the checkpoint loop at step
boundaries, and any exception takes the failure edge to teardown. Every transition is checked against
the graph and recorded as events, and the phases issue their collectives in plan order, so every rank
runs the same sequence.
"""

from __future__ import annotations

import logging
import time

from lifecycle.context import RunContext
from lifecycle.errors import ExitCode, LifecycleError, Shutdown, culprits, exit_code
from lifecycle.machine.graph import MAIN_PATH, TERMINAL, check_transition
from lifecycle.phases.base import PhaseHandler
from lifecycle.phases.init import InitPhase
from lifecycle.phases.teardown import TeardownPhase
from lifecycle.phases.train import TrainPhase
from lifecycle.phases.warmup import WarmupPhase
from lifecycle.recovery.inprocess import InProcessRestart

log = logging.getLogger(__name__)


class Orchestrator:
    """Runs the phases of one rank and returns the process exit code."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.current: str | None = None
        self.teardown = TeardownPhase()
        self.handlers: dict[str, PhaseHandler] = {
            "init": InitPhase(), "warmup": WarmupPhase(), "train": TrainPhase(self.checkpoint),
            "teardown": self.teardown,
        }
        missing = set(MAIN_PATH) - set(self.handlers)
        if missing:
            raise RuntimeError(f"no handler for main-path phases {sorted(missing)}")
        self._entered: dict[str, float] = {}
        self.error: BaseException | None = None
        self.shutdown: Shutdown | None = None
        """The :class:`Shutdown` the launcher's SIGTERM raised in this rank (set by the signal handler)."""

    def _enter(self, phase: str, *, failure: bool = False) -> None:
        check_transition(self.current, phase, failure=failure)
        for hook in self.ctx.phase_hooks:
            hook(self.ctx, self.current, phase, failure)
        self._end_current()
        self.current = phase
        self._entered[phase] = time.monotonic()
        self.ctx.events.phase = phase
        self.ctx.events.emit("begin", f"phase:{phase}", failure=failure or None)
        self.ctx.events.flush()  # the launcher reads the phase of a dead rank from this file
        self.ctx.drills.fire(phase)

    def _end_current(self) -> None:
        """The end event of the phase being left (with its duration)."""
        if self.current is not None:
            self.ctx.events.emit("end", f"phase:{self.current}", phase=self.current,
                                 dur_us=int((time.monotonic() - self._entered[self.current]) * 1e6))

    def enter(self, phase: str) -> None:
        """Enter ``phase`` (a legal transition of the graph, recorded as events)."""
        self._enter(phase)

    def checkpoint(self, ctx: RunContext, reason: str) -> None:
        """train -> checkpoint -> train (called by the train phase at a step boundary)."""
        from lifecycle.phases.checkpoint import save

        self._enter("checkpoint")
        save(ctx, reason)
        self._enter("train")

    def begin(self) -> None:
        """The phases before training (init, warmup unless disabled), then enter train. Raises; the caller takes
        the failure edge (:meth:`fail`). Every rank calls it: the phases are collective."""
        ctx = self.ctx
        for phase in MAIN_PATH[:MAIN_PATH.index("train")]:
            handler = self.handlers[phase]
            if handler.enabled(ctx):
                self._enter(phase)
                handler.run(ctx)
        self._enter("train")

    def run(self) -> int | InProcessRestart:
        """Run every phase of the main path; the exit code (0, or the policy's code for the failure), or the
        restart in place the ranks agreed on (``restart.mode: in_process``): the caller builds the next attempt."""
        try:
            self.begin()
            self.handlers["train"].run(self.ctx)
            return self._teardown()
        except BaseException as exc:  # noqa: BLE001 - every failure takes the failure edge
            self.error = exc  # first: from here a launcher's SIGTERM does not raise (it did in _explained: exit 1)
            exc = self._explained(exc)
            if self.ctx.policy.restart.mode == "in_process" and self.ctx.policy.restart.max_restarts:
                restart = self._restart_in_place(exc)
                if isinstance(restart, InProcessRestart):
                    return restart
                exc = restart
            return self.fail(exc)

    def _restart_in_place(self, exc: BaseException) -> InProcessRestart | BaseException:
        """Leave the failed phase, destroy the process groups and agree with every rank on the store to restart in
        place; the restart, or the error the failure path continues with (a line says why not)."""
        from lifecycle.distributed.sockets import cut_connections, store_port
        from lifecycle.phases.teardown import FAILURE_STEP_S, HardDeadline
        from lifecycle.recovery import inprocess
        from lifecycle.watchdog.causes import classify

        ctx, phase = self.ctx, self.current
        failed_at, t0 = time.time(), time.monotonic()
        self.error = exc  # from here a launcher's SIGTERM does not raise (the failure path follows a refusal)
        bound = ctx.policy.restart.in_process_deadline_s
        # Bounded like the failure path: a call that blocks cannot keep the process past the agreement.
        timer = HardDeadline(bound + 4 * FAILURE_STEP_S + 10.0, self.exit_code(exc)).start()
        try:
            # First, the peers blocked on this rank leave their collectives (gloo cannot abort them), and so do this
            # rank's own pending ones: each rank that fails cuts at once, so a chain of waits unwinds at once.
            cut = cut_connections(store_port())
            if ctx.watchdog is not None:  # tells the peers (the alarm) and names the culprit
                exc = self.error = ctx.watchdog.on_failure(exc)
            report = ctx.watchdog.reported if ctx.watchdog is not None else None
            kind = classify(exc)
            cause = report.cause if report is not None and kind in ("peer", "failed", "sequence") else kind
            refused = inprocess.refusal(ctx, phase, cause)
            code = self.exit_code(exc)
            log.warning("%s on rank %d in phase %s: %s", type(exc).__name__, ctx.rank, phase, exc,
                        exc_info=exc if kind == "failed" and not isinstance(exc, LifecycleError) else None)
            base = ctx.comms.store
            report_s = time.monotonic() - t0
            refused = refused or self._drain_pending_save(bound - report_s)
            with ctx.events.span("restart:destroy", connections_cut=cut):  # in the policy's failure order
                skipped = self.teardown.release(ctx)
            destroy_s = time.monotonic() - t0 - report_s
            if base is None:
                refused = refused or "this rank has no store to agree on"
            elif skipped:
                refused = refused or f"{', '.join(skipped)} did not return: its process groups cannot be re-created"
            t1 = time.monotonic()
            with ctx.events.span("restart:agree", refused=refused):
                why = inprocess.agree(ctx, base, refused, max(bound - report_s - destroy_s, 1.0)) if base is not None \
                    else refused
            if why is not None or base is None:
                then = "leaving for a relaunch" if ctx.progress.restarts_left > 0 else "leaving (no restarts left)"
                print(f"[rank {ctx.rank}] restart in place not possible ({why}): {then}", flush=True)
                ctx.events.instant("restart_refused", why=why)
                return exc
            ctx.events.instant("failure", error=type(exc).__name__, message=str(exc)[:2000], exit_code=code,
                               in_process=True)
            who = report.culprits if report is not None else culprits(exc)
            what = report.detail if report is not None else f"{type(exc).__name__}: {exc}"  # the cause, not its echo
            restart = inprocess.InProcessRestart(
                ctx.attempt, code, what[:300], cause, [int(r) for r in who or []],
                phase, ctx.step, failed_at, round(report_s, 4), round(destroy_s, 4), round(time.monotonic() - t1, 4), base)
        finally:
            timer.cancel()
        self._end_current()
        return restart

    def finish(self) -> int:
        """The success path's teardown (the failure edge if it fails); the exit code."""
        return self._teardown()

    def fail(self, exc: BaseException) -> int:
        """The failure edge for ``exc``; the policy's exit code."""
        self.error = exc  # first: from here a launcher's SIGTERM does not raise (it did in _explained: no exit event)
        exc = self._explained(exc)
        try:
            return self._fail(exc)
        except Shutdown:
            # The launcher's SIGTERM landed as the failure path began, before it marked itself (``self.error``,
            # which stops the signal handler from raising): nothing of it ran yet, so it starts again, once.
            return self._fail(exc)

    def _explained(self, exc: BaseException) -> BaseException:
        exc = self._unmasked(exc)
        return self._storage(exc)

    def _unmasked(self, exc: BaseException) -> BaseException:
        """The launcher's :class:`Shutdown` where a library turned it into an error of its own.

        The signal handler raises it wherever the main thread is; inside a C++ callback (torch.save's writer, a
        pybind hook) it comes out as that library's error (``unexpected pos 704 vs 598``), which would make this
        rank look like it failed by itself. Once the launcher is taking the job down, whatever this rank raises
        next is the consequence of another rank's failure, whatever its type."""
        raised = self.shutdown
        if raised is None or isinstance(exc, Shutdown):
            return exc
        seen: set[int] = set()
        link: BaseException | None = exc
        while link is not None and id(link) not in seen:  # the Shutdown itself, kept as a cause or context
            if isinstance(link, Shutdown):
                return link
            seen.add(id(link))
            link = link.__cause__ or link.__context__
        unmasked = Shutdown(f"{raised} (it surfaced as {type(exc).__name__}: {' '.join(str(exc).split())[:300]})")
        unmasked.__cause__ = exc
        return unmasked

    def _storage(self, exc: BaseException) -> BaseException:
        """A write a file system refused (read-only, full, over quota) as one line naming the run's folder it hit
        (:class:`~lifecycle.errors.StorageError`, logged without a traceback: the disk is at fault, not the code)."""
        from lifecycle.rundir.safeio import storage_error

        folders = {"checkpoint.dir": self.ctx.policy.checkpoint.dir, "run.dir": str(self.ctx.run_dir)}
        fallback = "checkpoint.dir" if self.current == "checkpoint" else None
        return storage_error(exc, folders, fallback) or exc

    def _drain_pending_save(self, seconds: float) -> str | None:
        """An async save still writing must finish before the next attempt saves the same step again; why not."""
        pending, self.ctx.progress.pending_save = self.ctx.progress.pending_save, None
        if pending is None:
            return None
        try:
            pending.handle.wait_local(max(seconds, 1.0))
        except Exception as exc:  # noqa: BLE001 - its files are a torn save the next commit clears
            return f"the async save of step {pending.step} did not finish writing ({type(exc).__name__}: {exc})"
        return None

    def _teardown(self) -> int:
        self._enter(TERMINAL)
        deadline = self.teardown.arm(self.ctx)
        try:
            self.teardown.run(self.ctx)
        except BaseException as exc:  # noqa: BLE001
            deadline.step = "failure"
            return self._fail(exc, in_teardown=True)
        finally:
            deadline.cancel()
        self._finish(ExitCode.OK)
        return ExitCode.OK

    def _fail(self, exc: BaseException, *, in_teardown: bool = False) -> int:
        ctx = self.ctx
        self.error = exc
        # The hard exit timer runs from the first moment of the failure path: nothing below (store calls on a
        # dead link, an abort or destroy that blocks) can keep this process alive past teardown.deadline_s.
        deadline = self.teardown.deadline if in_teardown else self.teardown.arm(ctx, step="failure")
        if ctx.watchdog is not None:  # tells peers at once, reports who is stuck, may name a torch timeout a hang
            exc = self.error = ctx.watchdog.on_failure(exc)
        code = self.exit_code(exc)
        if deadline is not None:
            deadline.code = code if code != ExitCode.OK else deadline.code
        # An error of lifecycle's own says what to do; anything else (torch, megatron, a step handler) gets its
        # traceback in the rank's log: that is where the bug is. The launcher taking the job down after another
        # rank failed is no error of this rank's: one line, no traceback.
        if isinstance(exc, Shutdown):
            log.warning("rank %d stops in phase %s: %s", ctx.rank, self.current, exc)
        else:
            log.error("%s failed on rank %d in phase %s: %s", type(exc).__name__, ctx.rank, self.current, exc,
                      exc_info=None if isinstance(exc, LifecycleError) else exc)
        ctx.events.instant("failure", error=type(exc).__name__, message=str(exc)[:2000], exit_code=code)
        self._record(exc, code)
        if not in_teardown:
            self._enter(TERMINAL, failure=True)
        try:
            self.teardown.run_failure(ctx, exc)
        except BaseException as again:  # noqa: BLE001 - the first error is the one to report
            log.error("failure teardown also failed: %s", again)
        finally:
            if deadline is not None:
                deadline.cancel()
        self._finish(code)
        return code

    def exit_code(self, exc: BaseException) -> int:
        return exit_code(exc, self.ctx.policy.teardown.exit_codes)

    def _record(self, exc: BaseException, code: int) -> None:
        """The failure for torchrun's summary (``TORCHELASTIC_ERROR_FILE``, as ``@record`` writes it)."""
        from lifecycle.rundir.elastic import record_failure

        ranks = culprits(exc)
        reported = self.ctx.watchdog.reported if self.ctx.watchdog is not None else None
        if not ranks and reported is not None:
            ranks = reported.culprits
        record_failure(rank=self.ctx.rank, error=type(exc).__name__, message=str(exc), exit_code=code,
                       phase=self.current, group=exc.group if isinstance(exc, LifecycleError) else None,
                       ranks=[int(r) for r in ranks or []],
                       detail=f"events, logs and reports: {self.ctx.run_dir}")

    def _finish(self, code: int) -> None:
        ctx = self.ctx
        self._end_current()
        if ctx.rank == 0 and ctx.progress.started_attempt:
            from lifecycle.rundir import restarts

            restarts.record_end(ctx.run_dir, ctx.attempt, code)
        ctx.events.instant("exit", exit_code=code, step=ctx.step, saved=ctx.progress.saved or None,
                           resumed_from=ctx.progress.resumed_from, stop_step=ctx.progress.stop.stop_step,
                           stop_signal=ctx.progress.stop.preempt_signal, train_steps=ctx.policy.train.steps,
                           warmup_s=ctx.progress.warmup_s or None)
        ctx.events.close()
