"""Helpers for the worker scripts that tests/distributed/test_launch.py starts through launch_local.

Run as plain scripts (``python tests/distributed/workers/<name>.py ...``): this folder is on sys.path.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
RUN_DIR = Path(os.environ["LIFECYCLE_RUN_DIR"])


def init_gloo() -> None:
    """Init the default group on gloo via env:// (the launcher's store), with a short timeout."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=20))


def event(phase: str, kind: str = "mark", name: str = "step") -> None:
    path = RUN_DIR / "events" / f"rank_{RANK}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"t": time.time(), "rank": RANK, "phase": phase, "kind": kind, "name": name}
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def note(name: str, payload: object) -> None:
    """Leave a result for the test: run_dir/out/<name>.rank_<R>.json."""
    out = RUN_DIR / "out"
    out.mkdir(exist_ok=True)
    tmp = out / f".{name}.rank_{RANK}.tmp"
    tmp.write_text(json.dumps(payload))
    tmp.replace(out / f"{name}.rank_{RANK}.json")


def wait_for_note(name: str, rank: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (RUN_DIR / "out" / f"{name}.rank_{rank}.json").exists():
        if time.monotonic() > deadline:
            sys.exit(9)
        time.sleep(0.05)


def on_sigterm_note_marker() -> None:
    """On SIGTERM: record whether the launcher's .shutdown marker was there (shutdown vs preemption)."""

    def handler(signum: int, frame: object) -> None:
        note("sigterm", {"marker": (RUN_DIR / ".shutdown").exists()})
        os._exit(0)

    signal.signal(signal.SIGTERM, handler)
