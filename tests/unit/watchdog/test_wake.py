"""The watchdog looks at once when woken (a signal reached the rank: the launcher's marker may be there), not at its
next poll; a wake while it looks is not lost. Only under `lifecycle run`: under torchrun or srun a wake does nothing."""

from __future__ import annotations

import threading
import time

import pytest

from lifecycle.watchdog.core import Watchdog
from tests.unit.onerank import MakeCtx

pytestmark = pytest.mark.timeout(30)


def test_a_wake_makes_the_watchdog_look_now_not_a_poll_later(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"watchdog": {"enabled": True, "poll_interval_s": 5.0}})
    wd = Watchdog(ctx)
    assert not wd.quick  # not started by `lifecycle run`
    wd.quick = True
    looks: list[float] = []
    looked = threading.Event()

    def tick() -> None:
        looks.append(time.monotonic())
        if len(looks) == 2:
            wd.wake()  # a signal while it looks: the next look follows at once
        looked.set()

    wd._tick = tick  # type: ignore[method-assign]
    wd._sleep_s = lambda: 5.0  # type: ignore[method-assign]
    thread = threading.Thread(target=wd._run, daemon=True)
    thread.start()
    try:
        assert looked.wait(2)
        time.sleep(0.2)
        assert len(looks) == 1  # asleep until the next poll (5 s)
        t0 = time.monotonic()
        wd.wake()
        deadline = time.monotonic() + 2
        while len(looks) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(looks) == 3 and looks[2] - t0 < 0.5, [x - t0 for x in looks]
        time.sleep(0.2)
        assert len(looks) == 3  # then asleep again
    finally:
        wd._stop.set()
        wd._poke.set()
        thread.join(5)
    assert not thread.is_alive()
