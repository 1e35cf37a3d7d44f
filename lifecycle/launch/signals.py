"""The launcher's signals: SIGINT, SIGTERM, SIGHUP and SIGUSR1 recorded as a stop request from the launcher's first
instruction (:func:`record_early`) to its last — while it prepares an attempt, runs ranks, and between attempts —,
every handler torch or we replaced restored afterwards. A rank records them from its first instruction too, and its
session acts on what came before it took over.

torch's ``PContext.start`` replaces the handlers of the signals ``TORCHELASTIC_SIGNALS_TO_HANDLE`` names with ones
that raise; while it spawns the ranks it is given only those we do not trap (:func:`torch_leaves_our_signals`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from lifecycle.machine.stops import STOPS, take_early

_ACTIVE: list[SignalTrap] = []


class SignalTrap:
    """Records the stop signals (:data:`STOPS`, and ``extra`` ones: the policy's ``checkpoint.signals``) sent to the
    launcher; restores every handler torch or we replaced. A trap entered inside another shares what it received
    (a signal that came while the launcher prepared an attempt is the attempt's too); the first one takes what came
    before it (:func:`record_early`)."""

    _TRAPPED = STOPS

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.received: list[signal.Signals] = []
        self._saved: dict[signal.Signals, Any] = {}
        self._trapped = set(self._TRAPPED) | {s for n in extra if isinstance(s := getattr(signal, n, None),
                                                                            signal.Signals)}

    def __enter__(self) -> SignalTrap:
        if _ACTIVE:
            self.received = _ACTIVE[-1].received
        else:
            self.received.extend(take_early())
        _ACTIVE.append(self)
        if threading.current_thread() is threading.main_thread():
            # The same list PContext.start reads to decide which handlers to take over.
            names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
            sigs = {getattr(signal, n.strip(), None) for n in names.split(",")} | self._trapped
            self._saved = {s: signal.getsignal(s) for s in sigs if isinstance(s, signal.Signals)}
            self.arm()
        return self

    def arm(self) -> None:
        for s, old in self._saved.items():
            signal.signal(s, self._on_signal if s in self._trapped else _handler(old))

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum))

    def __exit__(self, *exc: object) -> None:
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
        for s, old in self._saved.items():
            signal.signal(s, _handler(old))


@contextlib.contextmanager
def torch_leaves_our_signals() -> Iterator[None]:
    """While ``PContext.start`` spawns the ranks, it replaces the handlers of the signals its environment variable
    names with ones that raise in the middle of the spawn (ranks started by then would be left untracked): let it
    take the ones we do not trap, so that a SIGINT/SIGTERM in that moment is recorded by ours like any other."""
    name = "TORCHELASTIC_SIGNALS_TO_HANDLE"
    before = os.environ.get(name)
    os.environ[name] = "SIGQUIT"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _handler(old: Any) -> Any:
    return signal.SIG_DFL if old is None else old
