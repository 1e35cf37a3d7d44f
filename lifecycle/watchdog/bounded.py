"""Store I/O that can never block the thread that must act.

A TCPStore client call on a dead connection (a cut network link) can block for minutes whatever its
``set_timeout`` says. So the watchdog never calls the store itself: a :class:`BoundedChannel` owns one
daemon I/O thread with its own client (connected there, too: connecting can block as well), and every call
is handed to that thread and waited for at most ``op_timeout_s``. A call that does not return in time is
abandoned — the I/O thread may stay blocked in it forever — and every later call fails at once until it
returns: the caller gets :class:`StoreUnavailable` and carries on with what it knows locally.

``down_since`` says since when no call has succeeded; the watchdog calls the side channel lost when that
lasts ``heartbeat_stale_s``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from lifecycle.errors import StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C")


class _Call(Generic[C, T]):
    def __init__(self, fn: Callable[[C], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class BoundedChannel(Generic[C]):
    """Runs ``fn(channel)`` calls on a private I/O thread, each bounded by ``op_timeout_s``.

    ``connect`` (run on the I/O thread) returns the channel object, or None when there is nothing to connect
    to (then every call fails with StoreUnavailable and ``down_since`` stays None: no store is not a lost store).
    """

    def __init__(self, connect: Callable[[], C | None], *, op_timeout_s: float, name: str,
                 address: str = "?", start: bool = True) -> None:
        self.op_timeout_s = op_timeout_s
        self.address = address
        self.name = name
        self.down_since: float | None = None
        """Monotonic time of the first failure since the last success (None while the store answers)."""
        self.down_since_wall: float | None = None
        self.last_error: str | None = None
        self._channel: C | None = None
        self._absent = False
        self._connected = threading.Event()
        self._requests: queue.SimpleQueue[_Call[C, object] | None] = queue.SimpleQueue()
        self._pending: _Call[C, object] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, args=(connect,), name=name, daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the I/O thread (connecting first), when the constructor was told not to."""
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    # ---- the I/O thread -------------------------------------------------------------------------------
    def _serve(self, connect: Callable[[], C | None]) -> None:
        started = time.monotonic()
        try:
            self._channel = connect()
            self._absent = self._channel is None
        except Exception as exc:  # noqa: BLE001 - reported through the calls that follow
            self._note_failure(f"cannot connect: {type(exc).__name__}: {exc}", since=started)
        self._connected.set()
        while True:
            call = self._requests.get()
            if call is None:
                return
            try:
                if self._channel is None:
                    raise StoreUnavailable("not connected")
                call.result = call.fn(self._channel)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                call.error = exc
            call.done.set()

    # ---- callers ----------------------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._connected.is_set() and self._channel is not None

    @property
    def absent(self) -> bool:
        """True when there is no store to talk to at all (no MASTER_ADDR)."""
        return self._connected.is_set() and self._absent

    def call(self, fn: Callable[[C], T], timeout_s: float | None = None) -> T:
        """``fn(channel)`` on the I/O thread, waited for at most ``timeout_s`` (default ``op_timeout_s``).

        Raises StoreUnavailable when it did not return in time, a previous call is still stuck, there is no
        connection, or the call failed; never blocks longer than the timeout.
        """
        with self._lock:
            if not self._connected.is_set():
                raise StoreUnavailable("still connecting")
            if self._absent:
                raise StoreUnavailable("no store (MASTER_ADDR/MASTER_PORT not set)")
            if self._pending is not None and not self._pending.done.is_set():
                self._note_failure(self.last_error or "a call is still blocked")
                raise StoreUnavailable(f"a call to {self.address} is still blocked (abandoned)")
            call: _Call[C, object] = _Call(fn)
            self._pending = call
            self._requests.put(call)
        if not call.done.wait(self.op_timeout_s if timeout_s is None else timeout_s):
            self._note_failure(f"no answer within {self.op_timeout_s:g}s")
            raise StoreUnavailable(f"{self.address} did not answer within {self.op_timeout_s:g}s")
        if call.error is not None:
            if isinstance(call.error, StoreUnavailable):
                raise call.error
            self._note_failure(f"{type(call.error).__name__}: {call.error}")
            raise StoreUnavailable(f"{self.address}: {type(call.error).__name__}: {call.error}") from call.error
        self.down_since = self.down_since_wall = None
        self.last_error = None
        return call.result  # type: ignore[return-value]

    def wait_connected(self, timeout_s: float) -> bool:
        return self._connected.wait(timeout_s) and self._channel is not None

    def down_for(self) -> float:
        """Seconds since the store last answered (0 while it answers or when there is none)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def _note_failure(self, why: str, *, since: float | None = None) -> None:
        self.last_error = why
        if self.down_since is None:
            self.down_since = since if since is not None else time.monotonic()
            self.down_since_wall = time.time() - (time.monotonic() - self.down_since)

    def close(self, join_s: float = 0.0) -> None:
        """Stop the I/O thread once it is free, waiting up to ``join_s`` for it (a thread still blocked after that
        is a daemon: it dies with the process). A thread blocked in an abandoned call is not waited for: on a dead
        link it would only use up ``join_s``."""
        self._requests.put(None)
        stuck = self._pending is not None and not self._pending.done.is_set()  # abandoned: may never return
        if join_s > 0 and not stuck and self._thread.ident is not None \
                and self._thread is not threading.current_thread():
            self._thread.join(join_s)
