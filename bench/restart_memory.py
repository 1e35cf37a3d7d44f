"""Resident memory across in-process restarts: does a rank grow with every restart in place?

    .venv/bin/python bench/restart_memory.py [--restarts 3] [--nproc 2]

One `lifecycle run` of the default Megatron MoE job with `restart.mode=in_process`, `restart.max_restarts=N` and a
raise drill on rank 1 at step 3 of attempts 1..N (checkpoint every 2 steps): every attempt builds the model, trains,
fails and restarts in the same processes. Each rank's `restart_in_process` event records its resident memory after
the failed attempt was released and collected (`rss_bytes`) and what of it was still alive (`left_alive_modules`).
Printed per rank: RSS at each restart and its ratio to the first restart's (the baseline measured in the same run);
a leak shows as a ratio that climbs with N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    n = args.restarts
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        attempts = ", ".join(str(a) for a in range(1, n + 1))
        cmd = [sys.executable, "-m", "lifecycle", "run", "--nproc", str(args.nproc), f"run.dir={run}",
               "train.steps=6", "checkpoint.every_steps=2", "restart.mode=in_process",
               f"restart.max_restarts={n}", "restart.max_no_progress=0", "parallelism.ep=1",
               f"+faults=[{{at: train, step: 3, ranks: [1], action: raise, attempts: [{attempts}]}}]"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        print(f"lifecycle run exit {proc.returncode}")
        for path in sorted((run / "events").glob("rank_*.jsonl")):
            events = [json.loads(line) for line in path.read_text().splitlines() if '"restart_in_process"' in line]
            rss = [e.get("rss_bytes", 0) for e in events]
            left = [e.get("left_alive_modules") for e in events]
            ratios = [f"{r / rss[0]:.3f}" for r in rss] if rss and rss[0] else []
            print(f"{path.stem}: restarts {len(events)}, RSS MiB {[round(r / 2**20, 1) for r in rss]}, "
                  f"vs first {ratios}, modules left alive {left}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
