"""The restart ledger and the no-progress verdict (pure: no processes)."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.recovery import progress
from lifecycle.rundir import restarts
from lifecycle.rundir.restarts import Attempt, no_progress


def test_the_streak_counts_failed_attempts_the_tracker_did_not_move_past() -> None:
    a = [Attempt(1, None, "h", 4), Attempt(2, None, "h", 4)]
    assert no_progress(a, None, "h") == (2, None)  # no checkpoint ever
    a = [Attempt(1, None, "h", 4), Attempt(2, 5, "h", 3), Attempt(3, 5, "h", None)]
    assert no_progress(a, 5, "h") == (2, 5)  # attempt 1 committed step 5; 2 and 3 (killed) did not move past it
    assert no_progress(a, 10, "h") == (0, 10)  # attempt 3 committed 10 before it died: progress
    assert no_progress(a, 5, "other") == (0, 5)  # another policy starts the count over
    assert no_progress([*a[:2], Attempt(3, 5, "h", 0)], 5, "h") == (0, 5)  # a success ends the streak


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0, 3, 4, None])), max_size=8), st.integers(0, 3))
def test_the_streak_never_reaches_back_past_a_success_or_a_moved_tracker(history: list[tuple[int, int | None]],
                                                                          now: int) -> None:
    steps = sorted(s for s, _ in history)  # the tracker never goes back
    attempts = [Attempt(n, steps[n - 1], "h", code) for n, (_, code) in enumerate(history, start=1)]
    now = max([now, *steps])
    streak, since = no_progress(attempts, now, "h")
    tail = attempts[len(attempts) - streak:] if streak else []
    assert all(a.exit_code != 0 and a.start_step == now == since for a in tail)
    if streak < len(attempts):
        before = attempts[len(attempts) - streak - 1]
        assert before.exit_code == 0 or before.start_step != now


def test_the_ledger_tolerates_junk_and_hostile_files(tmp_path: Path) -> None:
    restarts.record_start(tmp_path, 1, None, "h")
    with open(tmp_path / restarts.LEDGER, "a") as f:
        f.write("not json\n[1, 2]\n{\"attempt\": \"x\"}\n")
    restarts.record_end(tmp_path, 1, 4)
    restarts.record_end(tmp_path, 1, 4)
    [only] = restarts.read(tmp_path)
    assert (only.number, only.start_step, only.exit_code) == (1, None, 4) and only.ended_at is not None
    msg = restarts.refusal(tmp_path, None, "h", 1)
    assert msg is not None and msg.startswith("1 attempts in a row failed before committing a checkpoint at all")
    assert restarts.refusal(tmp_path, None, "h", 0) is None  # 0: never refuse
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / restarts.LEDGER)  # a FIFO: no history, never a hang, and recording does not fail
    assert restarts.read(fifo) == [] and restarts.refusal(fifo, None, "h", 1) is None
    restarts.record_end(fifo, 1, 4)


def test_progress_is_read_where_a_trainer_commits_its_own_checkpoints(tmp_path: Path) -> None:
    """job.checkpoint(n, path) commits the trainer's folders and trackers outside checkpoint.dir: the next attempt's
    verdict reads them there, not the empty checkpoint.dir (which would count every attempt as no progress)."""
    from lifecycle.checkpoint import ckptdir
    from lifecycle.policy.load import validate

    run, own = tmp_path / "run", tmp_path / "save"
    run.mkdir()
    own.mkdir()
    policy = validate({"run": {"dir": str(run)}, "restart": {"max_no_progress": 2}})
    for attempt, step in ((1, 10), (2, 10)):  # both started from step 10, and failed
        restarts.record_start(run, attempt, step, "sha")
        restarts.record_end(run, attempt, 4)
    ckptdir.write_tracker(own, 20)
    assert progress.verdict(run, policy, "sha")[0] is not None  # checkpoint.dir alone: no progress seen
    restarts.record_checkpoint_dir(run, own)
    assert progress.verdict(run, policy, "sha") == (None, 20)
