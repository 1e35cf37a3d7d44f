"""The end of a job: the timeline never holds the exit code back for a large run."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle.launch.runner import END_OF_JOB_TIMELINE_BYTES, _timeline


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
