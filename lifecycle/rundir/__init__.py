"""The run directory: the one file protocol between the launcher, the ranks and the tools that read a run.

::

    <run_dir>/
      policy.resolved.yaml     the policy every rank runs (workers never compose)
      policy.sha256            its digest (ranks compare theirs at init)
      events/rank_<R>.jsonl    per-rank events (lifecycle.obs.events)
      logs/rank_<R>.log        stdout+stderr of rank R (local launcher)
      logs/rank_<R>.error.json the TORCHELASTIC_ERROR_FILE of rank R
      logs/rank_<R>.stacks.txt every thread's Python stack, dumped when the watchdog reports
      .shutdown                written by the local launcher when a rank failed: "this SIGTERM is a job
                               shutdown, not a preemption request" (JSON: rank, how, phase, reason)
      hang_report.json         the watchdog's full diagnosis (lowest live rank)
      summary.json             the end-of-run summary (launcher)
      trace.json, timeline.png the merged timeline
      overrides.txt            the command line's overrides of this attempt
      attempt                  the number of the current attempt (1 for a new run)
      attempts/<N>/            everything above of an earlier attempt N (events, logs, summary, reports ...),
                               moved there when the same command runs again in the same run directory
      checkpoints/             checkpoint.dir unless the policy puts it elsewhere

Pure Python: no torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lifecycle.jsontypes import JsonDict
from lifecycle.rundir import safeio

RESOLVED = "policy.resolved.yaml"
SHA256 = "policy.sha256"
EVENTS_DIR = "events"
LOGS_DIR = "logs"
SHUTDOWN_MARKER = ".shutdown"
HANG_REPORT = "hang_report.json"
SUMMARY = "summary.json"
TRACE = "trace.json"
TIMELINE_PNG = "timeline.png"
OVERRIDES = "overrides.txt"
ATTEMPT = "attempt"
ATTEMPTS_DIR = "attempts"
CHECKPOINTS_DIR = "checkpoints"
"""checkpoint.dir's default, inside the run directory (conf/config.yaml: ``${run.dir}/checkpoints``)."""
RANK_EVENTS = "rank_*.jsonl"
"""The glob of the per-rank events files in ``events/``."""
RUN_MARKER = ".lifecycle-run"
"""Written into every run directory lifecycle makes: a non-empty folder without it is someone else's."""
ENV_RUN_DIR = "LIFECYCLE_RUN_DIR"
ENV_ATTEMPT = "LIFECYCLE_ATTEMPT"
ENV_LAUNCHED = "LIFECYCLE_LAUNCHED_AT"
"""Wall-clock seconds when the local launcher began this launch: a rank forked from the preload process counts its
start-up from there (the imports it inherited happened before it existed)."""
MAX_ATTEMPT = 1_000_000
"""The largest attempt number a run directory may record (a run restarted every second for eleven days)."""
# What belongs to one attempt (moved to attempts/<N>/ before the next one starts); checkpoints stay.
_PER_ATTEMPT = (EVENTS_DIR, LOGS_DIR, SHUTDOWN_MARKER, HANG_REPORT, SUMMARY, TRACE, TIMELINE_PNG, RESOLVED, SHA256,
                OVERRIDES)


def events_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / EVENTS_DIR / f"rank_{rank}.jsonl"


def log_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / f"rank_{rank}.log"


def local_report_name(rank: int | str) -> str:
    """``hang_report.<rank>.json``: the report of a rank that could not reach its peers (side channel lost);
    ``"*"`` gives the glob of all of them."""
    stem, _, ext = HANG_REPORT.rpartition(".")
    return f"{stem}.{rank}.{ext}"


def stacks_file(run_dir: Path, rank: int) -> Path:
    """Where the watchdog dumps every thread's Python stack when it reports (appended to)."""
    return Path(run_dir) / LOGS_DIR / f"rank_{rank}.stacks.txt"


def error_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / f"rank_{rank}.error.json"


def write_marker(run_dir: Path, reason: str, **fields: object) -> None:
    """Write the shutdown marker atomically (a rank never reads half a marker)."""
    safeio.write_text(Path(run_dir) / SHUTDOWN_MARKER,
                      json.dumps({"t": time.time(), "reason": reason, **fields}) + "\n")


def read_marker(run_dir: Path) -> JsonDict | None:
    """The shutdown marker's fields; None when there is no marker, ``{}`` when it cannot be parsed."""
    path = Path(run_dir) / SHUTDOWN_MARKER
    if not path.exists():
        return None
    info = safeio.try_json(path, limit=1 << 16)  # never blocks, whatever is there
    return info if isinstance(info, dict) else {}


def has_marker(run_dir: Path) -> bool:
    return (Path(run_dir) / SHUTDOWN_MARKER).exists()


def clear_marker(run_dir: Path) -> None:
    (Path(run_dir) / SHUTDOWN_MARKER).unlink(missing_ok=True)


def last_event(run_dir: Path, rank: int) -> JsonDict | None:
    """The rank's ``failure`` event, else its last complete JSON line (a kill can cut the last one short)."""
    try:
        with safeio.open_regular(events_file(run_dir, rank)) as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))
            tail = f.read()
    except (OSError, safeio.RunDirError):
        return None
    last = None
    for line in reversed(tail.splitlines()):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("name") == "failure":  # the phase the rank failed in, not the teardown that followed
            return event
        last = last or event
    return last


# ---- attempts: running the same command again continues the run -------------------------------------
def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` already holds (the events of) a run."""
    return (Path(run_dir) / EVENTS_DIR).is_dir()


def current_attempt(run_dir: Path) -> int:
    """The attempt recorded in ``run_dir`` (1 when a run is there without a record, 0 when none is)."""
    path = Path(run_dir) / ATTEMPT
    text = safeio.read_text(path, limit=64)  # a FIFO or junk there is an error naming it, never a hang
    if text is None:
        return 1 if holds_run(run_dir) else 0
    raw = text.strip()
    if not (raw.isdigit() and raw.isascii() and len(raw) <= len(str(MAX_ATTEMPT)) and int(raw) <= MAX_ATTEMPT):
        raise safeio.RunDirError(f"{path}: holds {raw[:40]!r}, not an attempt number (1 ... {MAX_ATTEMPT}); "
                                 f"lifecycle writes it (fix it, or remove it to count from the attempts/ folders)",
                                 path=str(path))
    return max(int(raw), 1)


def archive_attempt(run_dir: Path) -> int:
    """Move the files of the attempt in ``run_dir`` into ``attempts/<N>/``; record and return N + 1.

    The local launcher calls it once, before any rank of the new attempt starts.
    """
    run_dir = Path(run_dir)
    previous = current_attempt(run_dir)
    if previous:
        target = run_dir / ATTEMPTS_DIR / str(previous)
        target.mkdir(parents=True, exist_ok=True)
        for name in _PER_ATTEMPT:
            if (run_dir / name).exists():
                os.replace(run_dir / name, target / name)
        for local in run_dir.glob(local_report_name("*")):  # the ranks' local reports (side channel lost)
            os.replace(local, target / local.name)
    safeio.write_text(run_dir / ATTEMPT, f"{previous + 1}\n")
    return previous + 1


def rank_attempt(run_dir: Path, rank: int) -> int:
    """This rank's attempt number when no local launcher decided it (torchrun, srun).

    Each rank reads the attempt number from the first event of its own events file of the previous attempt,
    moves that file into ``attempts/<N>/events/`` and continues as N + 1; rank 0 also moves the shared files.
    Every rank of the previous attempt wrote its file, so every rank reaches the same number.
    """
    run_dir = Path(run_dir)
    mine = events_file(run_dir, rank)
    previous = _first_attempt(mine)
    if previous is None:
        return 1 if rank != 0 else _start_attempt(run_dir)
    target = run_dir / ATTEMPTS_DIR / str(previous)
    (target / EVENTS_DIR).mkdir(parents=True, exist_ok=True)
    os.replace(mine, target / EVENTS_DIR / mine.name)
    # This rank's own files of that attempt (its local hang report, its stacks): a node's run directory may
    # hold no rank 0 to move the shared ones.
    for own in (run_dir / local_report_name(rank), stacks_file(run_dir, rank)):
        if own.exists():
            dest = target / own.relative_to(run_dir)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(own, dest)
    if rank == 0:
        for name in _PER_ATTEMPT:
            if name not in (EVENTS_DIR, LOGS_DIR, RESOLVED, SHA256) and (run_dir / name).exists():
                os.replace(run_dir / name, target / name)
        # The file's first attempt restarted in place (restart.mode: in_process) to the attempt recorded since:
        # the next is after that one (the other ranks agree on it at init).
        previous = max(previous, newer_attempt(run_dir, previous) or previous)
        safeio.write_text(run_dir / ATTEMPT, f"{previous + 1}\n")
    return previous + 1


def keep_report(run_dir: Path, attempt: int) -> None:
    """An attempt that restarted in place (its events and logs go on in the same files): its hang report moves to
    ``attempts/<N>/``, so that it is not taken for the report of the attempt after it."""
    report = Path(run_dir) / HANG_REPORT
    if report.is_file():
        target = Path(run_dir) / ATTEMPTS_DIR / str(attempt)
        try:
            target.mkdir(parents=True, exist_ok=True)
            os.replace(report, target / HANG_REPORT)
        except OSError:  # a report is no reason to fail a restart
            pass


def _start_attempt(run_dir: Path) -> int:
    safeio.write_text(run_dir / ATTEMPT, "1\n")
    return 1


def record_attempt(run_dir: Path, attempt: int) -> None:
    """Record ``attempt`` as the run's current one (rank 0, when the ranks agreed on another number than it counted)."""
    safeio.write_text(Path(run_dir) / ATTEMPT, f"{attempt}\n")


_AGREED_WITHIN = 256
"""Events at the head of a rank's file searched for the attempt the ranks agreed on (it follows init)."""


def _first_attempt(path: Path) -> int | None:
    """The attempt ``path`` was written in: the number the ranks agreed on at init when it differs from the one this
    rank counted (an ``attempt`` event with ``counted``), else the first event's (1 for files written before
    attempts were recorded); None when there is no such file."""
    try:
        with safeio.open_regular(path) as f:
            head = [f.readline(1 << 16) for _ in range(_AGREED_WITHIN)]
    except OSError:
        return None
    found = None
    for n, line in enumerate(head):
        try:
            event = json.loads(line)
        except (ValueError, TypeError, RecursionError):
            event = None
        if not isinstance(event, dict):
            if n == 0:
                return 1
            continue
        if n == 0 or (event.get("name") == "attempt" and "counted" in event):
            try:
                found = max(int(event.get("attempt", 1)), 1)
            except (ValueError, TypeError):
                found = found or 1
    return found or 1


def newer_attempt(run_dir: Path, attempt: int) -> int | None:
    """The newer attempt the run directory records, when a rank of ``attempt`` is still alive after it started (under
    torchrun/SLURM a requeued job can start while the old one drains): such a rank must not commit or report into
    the new attempt's files. None otherwise (a missing or unreadable record fences nothing)."""
    try:
        text = safeio.read_text(Path(run_dir) / ATTEMPT, limit=64)
        current = int(text.strip()) if text else 0
    except (safeio.RunDirError, OSError, ValueError):
        return None
    return current if current > attempt else None


def earlier_attempts(run_dir: Path) -> list[JsonDict]:
    """One line per earlier attempt, oldest first: its number, exit code, outcome and steps (from its summary)."""
    out: list[JsonDict] = []
    root = Path(run_dir) / ATTEMPTS_DIR
    numbers = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []
    for n in numbers:
        info: JsonDict = {"attempt": n}
        s = safeio.try_json(root / str(n) / SUMMARY)  # a FIFO, junk or 10^5 brackets there: no summary
        if isinstance(s, dict):
            info.update({k: s.get(k) for k in ("exit_code", "outcome", "resumed_from", "stop_step", "last_step",
                                               "blame", "in_process_restarts")})
        else:
            info["outcome"] = "no summary (the launcher did not finish)"
        out.append(info)
    return out


# ---- one launcher per run directory: lifecycle.rundir.runlock ------------------------------------------
LOCK = ".lock"

OWN = (EVENTS_DIR, LOGS_DIR, ATTEMPTS_DIR, CHECKPOINTS_DIR, SUMMARY, RESOLVED, SHA256, HANG_REPORT, OVERRIDES, ATTEMPT,
       LOCK, SHUTDOWN_MARKER, RUN_MARKER)
"""What a run directory holds that a tool writing into it must never overwrite (the timeline may replace its own
trace.json and timeline.png)."""
