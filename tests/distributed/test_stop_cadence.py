"""checkpoint.signal_check_every: the stop flag is agreed every n steps, so a preemption stops at the next such step;
checkpoint.signal_overlap: the flag is read one step after it is issued (the all-reduce runs during that step)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(90)
def test_a_signal_stops_at_the_next_agreed_step(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=0",
                        "checkpoint.signal_check_every=4", "checkpoint.signal_overlap=false",
                        "+faults=[{at: train, step: 5, ranks: [1], action: signal}]")
    assert run.code == 0, run.output
    assert "preempted at step 8, saved" in run.proc.stdout, run.output
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000008"
    for rank, events in run.events().items():
        agreed = [e.get("step") for e in events if e["name"] == "stop_flag" and e["kind"] == "end"]
        assert agreed == [None, 4, 8], (rank, agreed)  # before the first step, then every 4th step


@pytest.mark.timeout(90)
def test_an_overlapped_flag_is_read_one_step_later(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=0",
                        "checkpoint.signal_check_every=4", "+faults=[{at: train, step: 5, ranks: [1], action: signal}]")
    assert run.code == 0, run.output
    assert "preempted at step 9, saved" in run.proc.stdout, run.output  # issued after step 8, read after 9
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000009"
    for rank, events in run.events().items():
        flags = [e for e in events if e["name"] == "stop_flag" and e["kind"] == "end"]
        assert [(e.get("step"), e.get("issued_at"), bool(e.get("overlapped"))) for e in flags] == \
            [(None, None, False), (5, 4, True), (9, 8, True)], (rank, flags)
