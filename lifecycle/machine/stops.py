"""The stop signals of a ``lifecycle run`` process, recorded from its first instruction: a stop that comes before
its owner takes them over (the launcher's trap, :mod:`lifecycle.launch.signals`; a rank's session,
:func:`lifecycle.machine.session.install_signals`) is acted on by that owner, never lost nor fatal."""

from __future__ import annotations

import signal
import threading

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
"""The stop signals of ``lifecycle run``: SIGTERM (schedulers, Kubernetes), SIGINT (Ctrl-C), SIGHUP (a closed terminal
or ssh session) and SIGUSR1 (SLURM's ``--signal=USR1@lead``): each is a preemption request, from the launcher's first
instruction to its last (docs/running.md)."""
_EARLY: list[signal.Signals] = []


def record_early() -> None:
    """From a process's first instruction: record the stop signals instead of dying of them, until their owner (the
    launcher's trap, a rank's session) takes them over and acts on what came (:func:`take_early`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOPS:
        signal.signal(sig, _record)


def _record(signum: int, frame: object) -> None:
    _EARLY.append(signal.Signals(signum))


def take_early(keep: set[signal.Signals] | None = None) -> list[signal.Signals]:
    """The stop signals recorded since :func:`record_early`, once. ``keep``: the signals the caller now handles
    itself; the others get their default action back (a rank's session owns its policy's signals only)."""
    found = list(_EARLY)
    _EARLY.clear()
    if keep is not None and threading.current_thread() is threading.main_thread():
        for sig in STOPS:
            if sig not in keep and signal.getsignal(sig) is _record:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    return found
