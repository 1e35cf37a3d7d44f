"""BoundedChannel: a blocked store call never blocks the caller; the store being down is timed."""

from __future__ import annotations

import threading
import time

import pytest

from lifecycle.errors import StoreUnavailable
from lifecycle.watchdog.bounded import BoundedChannel

pytestmark = pytest.mark.timeout(30)


class FakeStore:
    """A channel whose calls block while ``gate`` is clear (a dead connection) and count otherwise."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0

    def ping(self) -> int:
        self.gate.wait()
        self.calls += 1
        return self.calls


def test_a_blocked_call_is_abandoned_and_later_calls_fail_at_once() -> None:
    store = FakeStore()
    io = BoundedChannel(lambda: store, op_timeout_s=0.2, name="test-io", address="h:1")
    assert io.wait_connected(5)
    assert io.call(lambda s: s.ping()) == 1 and io.down_for() == 0.0
    store.gate.clear()  # the link goes down
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="did not answer within 0.2s"):
        io.call(lambda s: s.ping())
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="still blocked"):
        io.call(lambda s: s.ping())
    assert time.monotonic() - t0 < 0.05  # no second wait behind the stuck call
    time.sleep(0.3)
    assert io.down_for() >= 0.3 and io.down_since_wall is not None
    store.gate.set()  # the link comes back: the stuck call returns, the next one succeeds
    time.sleep(0.1)
    assert io.call(lambda s: s.ping()) == 3 and io.down_for() == 0.0 and io.last_error is None
    io.close()


def test_a_failing_call_counts_as_down_and_names_the_error() -> None:
    def boom(_: object) -> None:
        raise ConnectionResetError("Broken pipe")

    io = BoundedChannel(lambda: object(), op_timeout_s=1.0, name="test-io", address="h:1")
    assert io.wait_connected(5)
    with pytest.raises(StoreUnavailable, match="ConnectionResetError: Broken pipe"):
        io.call(boom)
    assert io.down_since is not None and "Broken pipe" in (io.last_error or "")
    io.close()


def test_no_store_is_not_a_lost_store() -> None:
    io = BoundedChannel(lambda: None, op_timeout_s=1.0, name="test-io")
    io.wait_connected(5)
    assert io.absent
    with pytest.raises(StoreUnavailable, match="no store"):
        io.call(lambda s: s)
    assert io.down_for() == 0.0
    io.close()


def test_a_connect_that_blocks_never_blocks_a_caller() -> None:
    hold = threading.Event()

    def connect() -> object:
        hold.wait(10)
        return object()

    io = BoundedChannel(connect, op_timeout_s=1.0, name="test-io")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="still connecting"):
        io.call(lambda s: s)
    assert time.monotonic() - t0 < 0.05 and io.down_for() == 0.0
    hold.set()
    assert io.wait_connected(5)
    io.close()


def test_close_waits_for_an_idle_thread_but_not_for_one_stuck_in_an_abandoned_call() -> None:
    idle = BoundedChannel(lambda: FakeStore(), op_timeout_s=0.2, name="test-io", address="h:1")
    assert idle.wait_connected(5) and idle.call(lambda s: s.ping()) == 1
    idle.close(join_s=5)
    assert not idle._thread.is_alive()  # joined: no thread left in a C++ call at exit
    store = FakeStore()
    stuck = BoundedChannel(lambda: store, op_timeout_s=0.2, name="test-io", address="h:1")
    assert stuck.wait_connected(5)
    store.gate.clear()  # a dead link: the call never returns
    with pytest.raises(StoreUnavailable):
        stuck.call(lambda s: s.ping())
    t0 = time.monotonic()
    stuck.close(join_s=5)
    assert time.monotonic() - t0 < 0.5  # a partitioned rank leaves without waiting join_s for nothing
    store.gate.set()
