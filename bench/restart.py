"""Failure -> the first step of the next attempt, per stage, for `restart.max_restarts` (a relaunch), against a
fresh launch's own start-up measured in the same run, at world 4 and 8.

    .venv/bin/python bench/restart.py [--worlds 4 8] [--kind synthetic|megatron]

Each world runs one `lifecycle run` with `restart.max_restarts=1` and a crash drill at step 7 of attempt 1 only
(checkpoint every 5 steps). From the run directory's events and restart ledger, per stage of attempt 2:

    stop      the failure (the first end record of attempt 1) -> the first event of attempt 2 (the launcher brings
              the ranks down, archives the attempt, starts the processes; their imports)
    init      phase:init (process group, model-parallel groups, policy check), slowest rank
    warmup    phase:warmup, slowest rank
    setup     the step handler builds its model (and optimizer), slowest rank
    load      the resume span (verify and load the checkpoint), slowest rank
    step      the first step after the load, slowest rank
    other     the rest: the gaps between the stages on the slowest path (barriers, the ranks' skew, the stop flag)

and the same stages of attempt 1 (a fresh start: its start from the launcher's first line to its first event is
not in the ledger, so its `stop` column is empty). Ratios: attempt 2's failure->first step over attempt 1's first
event->first step. In-process restarts (`restart.mode: in_process`) are not available yet: relaunch only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

KINDS = {"synthetic": ["train.kind=synthetic", "~train.options", "moe.zero_token.action=off", "parallelism.ep=1"],
         "megatron": []}


def _events(folder: Path) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for f in sorted((folder / "events").glob("rank_*.jsonl")):
        out[int(f.stem.split("_")[1])] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _span(events: dict[int, list[dict[str, Any]]], name: str) -> float:
    """The slowest rank's total seconds in spans called ``name`` (0 when none)."""
    return max((sum(e.get("dur_us", 0) for e in evs if e["name"] == name and e["kind"] == "end") / 1e6
                for evs in events.values()), default=0.0)


def _first_step_after(events: dict[int, list[dict[str, Any]]], name: str) -> float:
    """The slowest rank's first step span after the first ``name`` span."""
    worst = 0.0
    for evs in events.values():
        seen = False
        for e in evs:
            seen = seen or (e["name"] == name and e["kind"] == "end")
            if seen and e["name"] == "step" and e["kind"] == "end":
                worst = max(worst, e["dur_us"] / 1e6)
                break
    return worst


def _first_step_end(events: dict[int, list[dict[str, Any]]]) -> float:
    return max(next(e["t"] for e in evs if e["name"] == "step" and e["kind"] == "end") for evs in events.values()) / 1e6


def stages(run_dir: Path) -> dict[str, dict[str, float]]:
    from lifecycle.launch import restarts

    ledger = {a.number: a for a in restarts.read(run_dir)}
    out = {}
    for n, folder in ((1, run_dir / "attempts" / "1"), (2, run_dir)):
        ev = _events(folder)
        start = min(evs[0]["t"] for evs in ev.values()) / 1e6
        ended = ledger[1].ended_at if n == 2 else None
        row = {"stop": (start - ended) if ended else 0.0, "init": _span(ev, "phase:init"),
               "warmup": _span(ev, "phase:warmup"), "setup": _span(ev, "setup"), "load": _span(ev, "resume"),
               "step": _first_step_after(ev, "resume" if n == 2 else "setup")}
        total = _first_step_end(ev) - (ended if ended else start)
        row["other"] = total - sum(row.values())
        row["total"] = total
        out[f"attempt {n}"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--kind", choices=sorted(KINDS), default="synthetic")
    args = parser.parse_args()
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            cmd = [sys.executable, "-m", "lifecycle", "run", "--nproc", str(world), f"run.dir={run_dir}",
                   *KINDS[args.kind], "train.steps=10", "checkpoint.every_steps=5", "restart.max_restarts=1",
                   "+faults=[{at: train, step: 7, ranks: [1], action: crash, attempts: [1]}]"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
            got = stages(run_dir)
        print(f"\nworld {world} ({args.kind}): seconds per stage, slowest rank")
        print(f"  {'':<10}" + "".join(f"{k:>9}" for k in got["attempt 1"]))
        for name, row in got.items():
            print(f"  {name:<10}" + "".join(f"{v:>9.2f}" for v in row.values()))
        print(f"  restart (failure -> first step) / fresh start (first event -> first step): "
              f"{got['attempt 2']['total']:.2f} / {got['attempt 1']['total']:.2f} = "
              f"{got['attempt 2']['total'] / got['attempt 1']['total']:.2f}")


if __name__ == "__main__":
    main()
