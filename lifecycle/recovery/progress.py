"""The no-progress verdict: the restarts ledger (:mod:`lifecycle.rundir.restarts`) read against the step the
checkpoint tracker names now. What the local launcher asks before it starts an attempt and rank 0 asks at init."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lifecycle.checkpoint import ckptdir
from lifecycle.rundir import restarts

if TYPE_CHECKING:
    from lifecycle.policy.schema import Policy


def tracker_step(folder: str | Path) -> int | None:
    """The step the checkpoint tracker names now, or None (no checkpoint, or a tracker that cannot be used)."""
    tracker = ckptdir.read_tracker(Path(folder))
    return ckptdir.step_of(tracker.name) if tracker.name else None


def verdict(run_dir: Path, policy: Policy, sha256: str) -> tuple[str | None, int | None]:
    """The line the next attempt of ``policy`` refuses to start with (or None), and the tracker's step it starts
    from."""
    step = tracker_step(restarts.checkpoint_dir(run_dir, policy.checkpoint.dir))
    return restarts.refusal(run_dir, step, sha256, policy.restart.max_no_progress), step
