"""What a rank stuck before training does when a stop signal finds it (lifecycle.machine.blocked_stop): the exit
code and the events. The watcher thread itself runs under real torchrun in
tests/distributed/test_stop_before_training.py."""

from __future__ import annotations

import pytest

from lifecycle.machine import blocked_stop
from lifecycle.obs.events import read_events
from lifecycle.rundir import write_marker
from tests.unit.onerank import MakeCtx

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("marker, code", [(False, 0), (True, 14)])
def test_a_stop_before_training_leaves_0_and_the_launchers_shutdown_the_rank_failed_code(
        make_ctx: MakeCtx, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], marker: bool,
        code: int) -> None:
    import lifecycle.watchdog.core as core

    ctx = make_ctx({"teardown": {"exit_codes": {"rank_failed": 14}}})  # the policy's code
    if marker:
        write_marker(ctx.run_dir, "rank 1 failed", rank=1)
    left: list[tuple[int, str]] = []
    monkeypatch.setattr(core, "abort_and_exit", lambda _ctx, c, *, by: left.append((c, by)))  # not os._exit here
    blocked_stop.BlockedStop._leave(ctx, "init", "SIGTERM")
    assert left == [(code, "signal")]
    ctx.events.flush()
    stop = [e for e in read_events(ctx.run_dir)[0] if e["name"] == "stop_before_training"]
    assert stop and stop[0]["stuck_in"] == "init" and stop[0]["exit_code"] == code
    out = capsys.readouterr().out
    assert f"leaving now (exit {code})" in out
    assert ("the launcher is taking the job down" in out) == marker
