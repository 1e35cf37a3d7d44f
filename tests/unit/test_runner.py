"""The end of a job: the timeline never holds the exit code back for a large run."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle.obs.timeline import END_OF_JOB_TIMELINE_BYTES
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
    assert not (tmp_path / "trace.json").exists()


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
