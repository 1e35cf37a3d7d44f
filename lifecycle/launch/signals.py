"""The launcher's signals: SIGINT/SIGTERM recorded as a stop request while the launcher runs ranks (and between its
attempts), every handler torch or we replaced restored afterwards.

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


class SignalTrap:
    """Records SIGINT/SIGTERM sent to the launcher; restores every handler torch or we replaced."""

    _TRAPPED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self._saved: dict[signal.Signals, Any] = {}

    def __enter__(self) -> SignalTrap:
        if threading.current_thread() is threading.main_thread():
            # The same list PContext.start reads to decide which handlers to take over.
            names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
            sigs = {getattr(signal, n.strip(), None) for n in names.split(",")} | set(self._TRAPPED)
            self._saved = {s: signal.getsignal(s) for s in sigs if isinstance(s, signal.Signals)}
            self.arm()
        return self

    def arm(self) -> None:
        for s, old in self._saved.items():
            signal.signal(s, self._on_signal if s in self._TRAPPED else _handler(old))

    def _on_signal(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum))

    def __exit__(self, *exc: object) -> None:
        for s, old in self._saved.items():
            signal.signal(s, _handler(old))


@contextlib.contextmanager
def torch_leaves_our_signals() -> Iterator[None]:
    """While ``PContext.start`` spawns the ranks, it replaces the handlers of the signals its environment variable
    names with ones that raise in the middle of the spawn (ranks started by then would be left untracked): let it
    take the ones we do not trap, so that a SIGINT/SIGTERM in that moment is recorded by ours like any other."""
    name = "TORCHELASTIC_SIGNALS_TO_HANDLE"
    before = os.environ.get(name)
    os.environ[name] = "SIGHUP,SIGQUIT"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _handler(old: Any) -> Any:
    return signal.SIG_DFL if old is None else old
