"""The end of a job: the timeline never holds the exit code back for a large run, and is drawn by a child process
beside the goodput read, within a deadline and not past a stop."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lifecycle.obs.timeline import END_OF_JOB_TIMELINE_BYTES, start_end_of_job
from lifecycle.obs.timeline import end_of_job as _timeline


def test_a_large_run_is_not_drawn_at_the_end_of_the_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = tmp_path / "events"
    events.mkdir()
    with open(events / "rank_0.jsonl", "wb") as f:
        f.truncate(END_OF_JOB_TIMELINE_BYTES + 1)  # sparse: its size is what counts
    _timeline(tmp_path)
    out = capsys.readouterr().out
    assert "trace    skipped at the end of the job: 32 MiB of events" in out
    assert f"lifecycle timeline {tmp_path}" in out
    assert not (tmp_path / "trace.json").exists() and not list(tmp_path.glob(".*"))  # nor half of one


def test_an_attempt_stopped_before_its_ranks_wrote_anything_is_recorded_as_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM in the restart window can stop attempt 2's ranks before any of them wrote an event: the ledger
    records attempt 2's end, and attempt 1's exit code stays."""
    import json
    import signal

    from lifecycle import rundir
    from lifecycle.launch import local, runner
    from lifecycle.policy.load import validate
    from lifecycle.rundir import restarts

    run_dir = tmp_path / "run"
    policy = validate({"run": {"dir": str(run_dir), "id": "unit"}, "train": {"kind": "synthetic", "steps": 4}})
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "events" / "rank_0.jsonl").write_text(json.dumps({"t": 1.0, "name": "attempt", "attempt": 1}) + "\n")
    rundir.record_attempt(run_dir, 1)
    restarts.record_end(run_dir, 1, 4)

    def stopped_at_once(argv: list[str], nproc: int, where: Path, **kwargs: object) -> local.LaunchResult:
        return local.LaunchResult(128 + signal.SIGTERM, None, None, None, {0: -signal.SIGTERM, 1: -signal.SIGTERM},
                                  0.1, "SIGTERM")

    monkeypatch.setattr(local, "launch_local", stopped_at_once)
    code, _, stopped, started = runner._attempt(policy, 2, run_dir, [], 0, local.PreloadPool())
    assert (code, stopped, started) == (143, True, 2)
    assert {a.number: a.exit_code for a in restarts.read(run_dir)} == {1: 4, 2: 143}


def _events(run_dir: Path, steps: int) -> None:
    """Rank 0 of a short run, through the real EventLog."""
    from lifecycle.obs.events import EventLog

    log = EventLog(run_dir, 0, 0)
    log.phase = "train"
    for step in range(1, steps + 1):
        log.step = step
        with log.span("step"):
            pass
    log.instant("exit", exit_code=0)
    log.close()


def test_the_trace_is_drawn_by_a_child_beside_the_goodput_read_and_said_after_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle.obs import goodput

    _events(tmp_path, 50)
    drawing = start_end_of_job(tmp_path, "trace")
    assert drawing is not None
    print("goodput  read here meanwhile")
    goodput.account(tmp_path)
    drawing.finish()
    out = capsys.readouterr().out
    assert out.index("goodput  read here") < out.index(f"trace    {tmp_path / 'trace.json'} (")
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert not (tmp_path / "timeline.png").exists() and drawing.proc.returncode == 0
    assert start_end_of_job(tmp_path, "off") is None


@pytest.mark.parametrize("why", ["stop", "deadline"])
def test_a_stop_or_the_deadline_cuts_the_drawing_short_and_says_how_to_draw_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], why: str) -> None:
    _events(tmp_path, 20_000)  # a few seconds of drawing
    drawing = start_end_of_job(tmp_path, "trace")
    assert drawing is not None
    t0 = time.monotonic()
    if why == "stop":
        drawing.finish(lambda: time.monotonic() - t0 > 0.2)
    else:
        drawing.finish(limit_s=0.2)
    assert time.monotonic() - t0 < 2.0 and drawing.proc.returncode is not None
    said = "a stop signal came" if why == "stop" else "not done in 0s"
    assert f"trace    not drawn ({said}): draw it with `lifecycle timeline {tmp_path}`" in capsys.readouterr().out
    assert not (tmp_path / "trace.json").exists() and not list(tmp_path.glob(".*"))  # nor half of one


def test_a_drawing_that_fails_is_said_and_changes_nothing_else(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "events").mkdir()  # nothing in it: `lifecycle timeline` refuses, with why
    drawing = start_end_of_job(tmp_path, "trace")
    assert drawing is not None
    drawing.finish()
    out, err = capsys.readouterr()
    assert "no events in" in err and f"trace    not written (exit 2): `lifecycle timeline {tmp_path}` says why" in out
