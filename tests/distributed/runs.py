"""Run `lifecycle run` as a subprocess with a hard timeout and read back what the ranks recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lifecycle.obs.events import read_events
from tests.helpers import ROOT

# Small deadlines so failure drills finish in seconds; teardown.deadline_s must stay >= the teardown deadline.
FAST = ["watchdog.deadlines.init=60", "watchdog.deadlines.warmup=20", "watchdog.deadlines.step=20",
        "watchdog.deadlines.checkpoint=30", "watchdog.deadlines.teardown=10", "teardown.deadline_s=15",
        "run.timeline=trace"]
"""Generous deadlines for a loaded 2-core machine, and the end-of-job trace without its picture (the Gantt takes
about half a second of every launch; the default job's test and the timeline tests draw it)."""
SYNTHETIC = ["train.kind=synthetic", "~train.options", "moe.zero_token.action=off", "parallelism.ep=1"]


@dataclass
class Run:
    proc: subprocess.CompletedProcess[str]
    run_dir: Path
    wall_s: float

    @property
    def code(self) -> int:
        return self.proc.returncode

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def events(self) -> dict[int, list[dict[str, Any]]]:
        return read_events(self.run_dir)

    def log(self, rank: int) -> str:
        path = self.run_dir / "logs" / f"rank_{rank}.log"
        return path.read_text() if path.exists() else ""

    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())


def lifecycle_run(tmp_path: Path, nproc: int, *overrides: str, timeout: float = 100,
                  env: dict[str, str] | None = None, timeline: str | None = "trace") -> Run:
    """``lifecycle run`` in ``tmp_path/run``. ``timeline``: the end-of-job picture is left out (``trace``: about a
    second of matplotlib per launch) unless the overrides or ``timeline=None`` (the policy's default) ask for it."""
    import os

    if timeline is not None and not any(o.lstrip("+~").startswith("run.timeline") for o in overrides):
        overrides = (f"run.timeline={timeline}", *overrides)
    run_dir = tmp_path / "run"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lifecycle", "run", "--nproc", str(nproc), f"run.dir={run_dir}",
                           *overrides], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    return Run(proc, run_dir, time.monotonic() - t0)
