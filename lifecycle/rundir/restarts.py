"""Restarts without a human: the run directory's ledger of attempts, and when to stop restarting.

``<run_dir>/restarts.jsonl`` (kept across attempts, like the checkpoints) holds one line when an attempt starts —
its number, the step the checkpoint tracker named then, the policy's sha256 — and one when it ends, with its exit
code (written by rank 0 as it exits and by the local launcher, which also sees a rank 0 that was killed). From it
:func:`no_progress` tells, before an attempt starts, how many attempts in a row failed without committing a
checkpoint newer than the one they started from; at ``restart.max_no_progress`` the attempt refuses to start
(:class:`~lifecycle.errors.NoProgress`, ``exit_codes.no_progress``). The local launcher asks before it launches
(``restart.max_restarts``); under torchrun ``--max-restarts`` or a SLURM requeue, rank 0 asks at init and every
rank leaves with the same code. Pure Python: no torch.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from lifecycle.jsontypes import JsonDict
from lifecycle.rundir import safeio

LEDGER = "restarts.jsonl"
_MAX_BYTES = 1 << 20
"""The ledger is read whole (a line per attempt start and end): a larger file is not ours, and is ignored."""


@dataclass(frozen=True)
class Attempt:
    number: int
    start_step: int | None
    sha256: str | None
    exit_code: int | None
    """None: no end was recorded (the launcher and rank 0 were killed): a failure."""
    ended_at: float | None = None
    """Wall time of the first end record (rank 0's exit, else the launcher's)."""


def record_start(run_dir: Path, attempt: int, start_step: int | None, sha256: str) -> None:
    _append(run_dir, {"attempt": attempt, "start_step": start_step, "sha256": sha256, "t": time.time()})


def record_end(run_dir: Path, attempt: int, exit_code: int) -> None:
    _append(run_dir, {"attempt": attempt, "exit_code": exit_code, "t": time.time()})


def _append(run_dir: Path, record: JsonDict) -> None:
    import os

    try:
        fd = safeio.open_append(Path(run_dir) / LEDGER)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except (OSError, safeio.RunDirError):  # a full disk or a FIFO there must not turn a run's end into another
        pass                               # failure: the next start sees no record


def read(run_dir: Path) -> list[Attempt]:
    """Every attempt the ledger records, oldest first (the last record of each wins; junk lines are skipped)."""
    try:
        text = safeio.read_text(Path(run_dir) / LEDGER, limit=_MAX_BYTES)
    except safeio.RunDirError:  # not ours (a FIFO, junk bytes, too large): no history, never a hang
        text = None
    merged: dict[int, JsonDict] = {}
    ended: dict[int, float] = {}
    for line in (text or "").splitlines():
        try:
            rec = json.loads(line)
            n = int(rec["attempt"])
        except (ValueError, TypeError, KeyError, RecursionError):
            continue
        if isinstance(rec, dict) and n >= 1:
            merged.setdefault(n, {}).update(rec)
            if "exit_code" in rec and isinstance(rec.get("t"), int | float):
                ended[n] = min(ended.get(n, float(rec["t"])), float(rec["t"]))
    out = []
    for n in sorted(merged):
        rec = merged[n]
        step, code = rec.get("start_step"), rec.get("exit_code")
        out.append(Attempt(n, step if isinstance(step, int) else None,
                           rec.get("sha256") if isinstance(rec.get("sha256"), str) else None,
                           code if isinstance(code, int) else None, ended.get(n)))
    return out


def no_progress(attempts: list[Attempt], now_step: int | None, sha256: str) -> tuple[int, int | None]:
    """How many of the latest attempts in a row failed without the tracker moving past the step they started from
    (with this policy), and that step. An attempt that succeeded, ran another policy or was followed by a newer
    checkpoint ends the streak."""
    streak, since, later = 0, now_step, now_step
    for a in reversed(attempts):
        if a.exit_code == 0 or (a.sha256 is not None and a.sha256 != sha256):
            break
        if later is not None and (a.start_step is None or later > a.start_step):
            break  # the tracker moved on during attempt a: it made progress
        streak += 1
        since = later = a.start_step
    return streak, since


def refusal(run_dir: Path, now_step: int | None, sha256: str, limit: int) -> str | None:
    """The line an attempt refuses to start with, or None (``limit`` 0: never refuse)."""
    if limit <= 0:
        return None
    streak, since = no_progress(read(run_dir), now_step, sha256)
    if streak < limit:
        return None
    where = f"newer than step {since}" if since is not None else "at all"
    return (f"{streak} attempts in a row failed before committing a checkpoint {where}; not restarting "
            f"(restart.max_no_progress={limit}; fix the cause, then run again with restart.max_no_progress=0 or "
            f"remove {Path(run_dir) / LEDGER})")


TRAINER_CHECKPOINTS = "trainer_checkpoints"
"""``<run_dir>/trainer_checkpoints``: the folder of a trainer's own commits (``job.checkpoint(n, path)`` commits its
``iter_NNNNNNN`` folders and trackers there, not in ``checkpoint.dir``): progress is read from its trackers."""


def record_checkpoint_dir(run_dir: Path, folder: Path) -> None:
    """Rank 0, at a trainer's commit: where this run's commits and trackers are (see :data:`TRAINER_CHECKPOINTS`)."""
    path = Path(run_dir) / TRAINER_CHECKPOINTS
    text = str(Path(folder).resolve()) + "\n"
    try:
        if safeio.read_text(path, limit=4096) != text:
            safeio.write_text(path, text)
    except (OSError, safeio.RunDirError):  # a note for the next attempt's verdict: never a reason to fail a commit
        pass


def checkpoint_dir(run_dir: Path, policy_dir: str | Path) -> Path:
    """Where the run's committed checkpoints are: a trainer's own folder when it commits there, else the policy's."""
    try:
        text = safeio.read_text(Path(run_dir) / TRAINER_CHECKPOINTS, limit=4096)
    except safeio.RunDirError:
        text = None
    return Path(text.strip()) if text and text.strip() else Path(policy_dir)
