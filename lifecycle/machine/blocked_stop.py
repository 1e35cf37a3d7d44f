"""A stop signal that reaches a rank stuck before training.

A stop signal (SIGTERM, the policy's ``checkpoint.signals``) sets a flag that every rank agrees on at the next step
boundary. A rank that never gets there, because it waits in init or warmup for a rank that is gone, waited until
the launcher's SIGKILL: under torchrun, a rank that failed in init makes the agent SIGTERM the others, and those
blocked in the rendezvous sat there 30 s with no exit event and no word of why. Worse, Python runs a handler only
between two bytecodes of the main thread, so a rank blocked in a C++ call may not even log the signal.

The C-level handler writes the signal's number to a wakeup file descriptor at once, whatever the main thread does;
a thread here reads it. When the rank is still before training (init or warmup: nothing to save) and has emitted no
event for :data:`QUIET_S` seconds since the signal, it leaves: exit 0, as a stop before training ends anyway, or the
rank-failed code when the launcher is taking the job down after a failure (its marker). A rank that moves on
(events, or the train phase) is left to the flag, which keeps the ranks together.

Every signal read there also wakes the rank's watchdog (it looks for the launcher's marker now, not at its next
poll): a rank blocked in a collective that a dead peer broke elsewhere in the ring is named at once.

Only in processes lifecycle owns (``lifecycle run``, torchrun or srun ranks): a trainer under ``attach()`` may use
the one wakeup descriptor a process has (asyncio does).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING

from lifecycle.errors import ExitCode, Shutdown, exit_code
from lifecycle.rundir import has_marker

if TYPE_CHECKING:
    from lifecycle.context import RunContext
    from lifecycle.machine.orchestrator import Orchestrator

log = logging.getLogger(__name__)
QUIET_S = 5.0
"""How long a rank before training may stay without an event after a stop signal before it leaves."""
BEFORE_TRAINING = (None, "init", "warmup")
"""The orchestrator's phases in which a stop has nothing to save (None: the run has not begun)."""


class BlockedStop:
    """The watcher of one process (see the module docstring). :meth:`watch` points it at the current attempt."""

    def __init__(self) -> None:
        self._ctx: RunContext | None = None
        self._orchestrator: Orchestrator | None = None
        self._signals: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self._ends: tuple[socket.socket, socket.socket] | None = None

    def watch(self, ctx: RunContext, orchestrator: Orchestrator, signals: set[int]) -> bool:
        """Watch ``signals`` for ``orchestrator``'s attempt (main thread); False where no wakeup fd can be set."""
        with self._lock:
            self._ctx, self._orchestrator, self._signals = ctx, orchestrator, frozenset(signals)
        if self._ends is not None:
            return True
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        try:
            signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        except ValueError as exc:  # not the main thread
            log.debug("no wakeup fd: %s", exc)
            read.close()
            write.close()
            return False
        self._ends = (read, write)  # both open as long as the process
        threading.Thread(target=self._run, args=(read,), name="lifecycle-blocked-stop", daemon=True).start()
        return True

    def _run(self, read: socket.socket) -> None:
        pending: tuple[int, int] | None = None  # (when it was read, µs; the signal)
        while True:
            # Asleep until a signal comes; then a look every 0.25 s while it waits for its rank to move on.
            ready, _, _ = select.select([read], [], [], None if pending is None else 0.25)
            if ready:
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    for signum in read.recv(512):
                        if signum in self._signals and pending is None:
                            pending = (int(time.time() * 1e6), signum)
                self._wake_watchdog()
            if pending is None:
                continue
            with self._lock:
                ctx, orchestrator = self._ctx, self._orchestrator
            if ctx is None or orchestrator is None or orchestrator.current not in BEFORE_TRAINING \
                    or orchestrator.error is not None:
                pending = None  # training began (the flag is in charge) or the failure path runs
                continue
            quiet_since = max(pending[0], ctx.events.last_t)
            if time.time() * 1e6 - quiet_since >= QUIET_S * 1e6:
                self._leave(ctx, orchestrator.current, signal.Signals(pending[1]).name)

    def _wake_watchdog(self) -> None:
        """A signal came: the rank's watchdog looks now (the local launcher signals the ranks right after it wrote
        its marker; a main thread blocked in a collective runs no handler until the collective returns)."""
        with self._lock:
            ctx = self._ctx
        watchdog = ctx.watchdog if ctx is not None else None
        if watchdog is not None:
            watchdog.wake()

    @staticmethod
    def _leave(ctx: RunContext, phase: str | None, name: str) -> None:
        from lifecycle.watchdog.core import abort_and_exit

        failing = has_marker(ctx.run_dir)
        code = exit_code(Shutdown(), ctx.policy.teardown.exit_codes) if failing else ExitCode.OK
        why = "the launcher is taking the job down" if failing else "a stop before training"
        print(f"[rank {ctx.rank}] {name} while in {phase or 'start-up'} and no progress for {QUIET_S:g}s: nothing to "
              f"save yet, {why}; leaving now (exit {code})", flush=True)
        ctx.events.instant("stop_before_training", signal=name, stuck_in=phase, exit_code=int(code), pid=os.getpid())
        abort_and_exit(ctx, int(code), by="signal")


WATCHER = BlockedStop()
"""This process's watcher."""
