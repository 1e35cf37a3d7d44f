"""Which deadline judges an async checkpoint's commit: it is finished at the next step boundary (and at the end of
train), where the step deadline — learned, seconds short — used to apply. A commit slower than the learned step
deadline but inside the checkpoint deadline is no hang: 2 real gloo ranks of ``lifecycle run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run

pytestmark = pytest.mark.distributed
SLOW_S = 3.0


@pytest.mark.timeout(120)
def test_an_async_commit_slower_than_the_learned_step_deadline_is_judged_by_the_checkpoint_deadline(
        tmp_path: Path) -> None:
    run = lifecycle_run(
        tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=12", "checkpoint.every_steps=6", "checkpoint.async=true",
        "watchdog.deadlines.step=auto", "watchdog.adaptive.calibration_steps=3", "watchdog.adaptive.floor_s=1",
        "watchdog.adaptive.factor=2", "watchdog.poll_interval_s=0.2", "watchdog.heartbeat_stale_s=20",
        # rank 1's writes of step 6 finish SLOW_S late: rank 0 waits in the commit without an event meanwhile
        f"+faults=[{{at: checkpoint, step: 6, ranks: [1], action: slow, seconds: {SLOW_S}, op: commit}}]")
    assert run.code == 0, run.output[-4000:]
    assert "HANG" not in run.output and not (run.run_dir / "hang_report.json").exists(), run.output[-4000:]
    events = run.events()
    learned = [e["seconds"] for e in events[0] if e["name"] == "deadline" and e.get("deadline") == "step"]
    assert learned and learned[-1] < SLOW_S, learned  # the step deadline in force was shorter than the commit
    commits = [e for e in events[0] if e["name"] == "commit" and e["kind"] == "end"]
    assert [c["step"] for c in commits] == [6, 12] and commits[0]["dur_us"] >= SLOW_S * 0.9e6
    assert all(c["phase"] == "checkpoint" for c in commits)  # committed inside the checkpoint phase
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000012"
