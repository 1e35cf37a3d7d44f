"""The run directory: the one file protocol between the launcher, the ranks and the tools that read a run.

::

    <run_dir>/
      policy.resolved.yaml     the policy every rank runs (workers never compose)
      policy.sha256            its digest (ranks compare theirs at init)
      events/rank_<R>.jsonl    per-rank events (lifecycle.obs.events)
      logs/rank_<R>.log        stdout+stderr of rank R (local launcher)
      logs/rank_<R>.error.json the TORCHELASTIC_ERROR_FILE of rank R
      .shutdown                written by the local launcher when a rank failed: "this SIGTERM is a job
                               shutdown, not a preemption request" (JSON: rank, how, phase, reason)
      hang_report.json         the watchdog's full diagnosis (lowest live rank)
      summary.json             the end-of-run summary (launcher)
      trace.json, timeline.png the merged timeline
      checkpoints/             checkpoint.dir unless the policy puts it elsewhere

Pure Python: no torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lifecycle.jsontypes import JsonDict

RESOLVED = "policy.resolved.yaml"
SHA256 = "policy.sha256"
EVENTS_DIR = "events"
LOGS_DIR = "logs"
SHUTDOWN_MARKER = ".shutdown"
HANG_REPORT = "hang_report.json"
SUMMARY = "summary.json"
TRACE = "trace.json"
TIMELINE_PNG = "timeline.png"
ENV_RUN_DIR = "LIFECYCLE_RUN_DIR"


def events_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / EVENTS_DIR / f"rank_{rank}.jsonl"


def log_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / f"rank_{rank}.log"


def error_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS_DIR / f"rank_{rank}.error.json"


def write_marker(run_dir: Path, reason: str, **fields: object) -> None:
    """Write the shutdown marker atomically (a rank never reads half a marker)."""
    tmp = Path(run_dir) / f"{SHUTDOWN_MARKER}.tmp"
    tmp.write_text(json.dumps({"t": time.time(), "reason": reason, **fields}) + "\n")
    tmp.replace(Path(run_dir) / SHUTDOWN_MARKER)


def read_marker(run_dir: Path) -> JsonDict | None:
    """The shutdown marker's fields; None when there is no marker, ``{}`` when it cannot be parsed."""
    path = Path(run_dir) / SHUTDOWN_MARKER
    if not path.exists():
        return None
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def has_marker(run_dir: Path) -> bool:
    return (Path(run_dir) / SHUTDOWN_MARKER).exists()


def clear_marker(run_dir: Path) -> None:
    (Path(run_dir) / SHUTDOWN_MARKER).unlink(missing_ok=True)


def last_event(run_dir: Path, rank: int) -> JsonDict | None:
    """The rank's ``failure`` event, else its last complete JSON line (a kill can cut the last one short)."""
    try:
        with events_file(run_dir, rank).open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))
            tail = f.read()
    except OSError:
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
