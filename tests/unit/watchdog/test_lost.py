"""A rank whose store stops answering reports "side channel lost" from its own state, locally, in bounded time."""

from __future__ import annotations

import json
import threading
import time

import pytest

from lifecycle.watchdog.bounded import BoundedChannel
from lifecycle.watchdog.core import Watchdog
from tests.unit.onerank import MakeCtx

pytestmark = pytest.mark.timeout(30)


class DeadLink:
    """A side channel whose every call blocks (a TCPStore client on a cut link)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        def blocked(*args: object, **kwargs: object) -> None:
            self.release.wait(20)
        return blocked


def test_a_dead_store_is_reported_as_side_channel_lost_with_this_ranks_position(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"watchdog": {"enabled": True, "action": "report", "heartbeat_stale_s": 0.5,
                                 "poll_interval_s": 0.1, "deadlines": {"init": 20, "warmup": 10, "step": 60,
                                                                        "checkpoint": 20, "teardown": 5}}})
    wd = Watchdog(ctx)
    wd.store_address = "10.0.0.1:29500"
    link = DeadLink()
    wd._io = BoundedChannel(lambda: link, op_timeout_s=0.2, name="test-io", address="10.0.0.1:29500")  # type: ignore[arg-type]
    assert wd._io.wait_connected(5)
    ctx.events.listeners.append(wd.progress.on_event)
    ctx.events.phase = "train"
    with ctx.events.span("step", step=7):
        t0 = time.monotonic()
        while wd.reported is None and time.monotonic() - t0 < 5:
            tick = time.monotonic()
            wd._tick()
            assert time.monotonic() - tick < 0.5  # the watchdog thread is never held by the dead link
            time.sleep(0.05)
    link.release.set()
    assert wd.reported is not None and wd.reported.cause == "lost"
    report = json.loads((ctx.run_dir / "hang_report.0.json").read_text())
    assert report["cause"] == "lost" and report["local"] is True
    assert "side channel lost: store 10.0.0.1:29500 unreachable since" in report["detail"]
    assert "step 7, in op step" in report["detail"]
    assert 0.5 < time.monotonic() - t0 < 3.0


def test_a_dead_ranks_last_flushed_event_beats_its_stale_record(make_ctx: MakeCtx) -> None:
    from lifecycle.obs.events import EventLog

    ctx = make_ctx({"watchdog": {"enabled": True}})
    wd = Watchdog(ctx)
    peer = EventLog(ctx.run_dir, 1)
    peer.phase, peer.step = "train", 22
    peer.instant("fault_drill", action="crash")
    peer.close()
    stale = {"rank": 1, "state": "running", "phase": "init", "step": None, "t": time.time() - 60,
             "op": ["initialize_model_parallel", "world", 2, None], "begun": {"world": 2}}
    records = {0: wd.progress.record(), 1: stale}
    wd._freshen(records, [1])
    assert records[1] is not None and records[1]["phase"] == "train" and records[1]["step"] == 22
    assert records[1]["op"] is None and records[1]["from_events"] == "instant fault_drill"
