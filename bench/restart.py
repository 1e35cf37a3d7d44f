"""Failure -> the first step of the next attempt, per stage: a relaunch (`restart.mode: relaunch`) against a restart
in the same processes (`restart.mode: in_process`) and a fresh launch's own start-up, measured in the same run, at
world 4 and 8.

    .venv/bin/python bench/restart.py [--worlds 4 8] [--kind synthetic|megatron]

Per world, two `lifecycle run`s with `restart.max_restarts=1` and a raise drill on rank 1 at step 7 of attempt 1 only
(checkpoint every 5 steps): one per mode. From the run directory's events and restart ledger, per stage of attempt 2:

    stop      relaunch: the failure (the first end record of attempt 1) -> the first event of attempt 2 (the launcher
              brings the ranks down, archives the attempt, starts the processes; their imports).
              in_process: the slowest rank's report (its connections cut, so the peers give up their collectives;
              the alarm; the diagnosis), destroy of its process groups and the agreement on the store
    init      phase:init (process group, model-parallel groups, policy check), slowest rank
    warmup    phase:warmup, slowest rank
    setup     the step handler builds its model (and optimizer), slowest rank
    load      the resume span (verify and load the checkpoint), slowest rank
    step      the first step after the load, slowest rank
    other     the rest: the gaps between the stages on the slowest path (barriers, the ranks' skew, the stop flag)

and the same stages of attempt 1 of the relaunch run (a fresh start: its start from the launcher's first line to its
first event is not in the ledger, so its `stop` column is empty). Ratios: each restart's failure->first step over the
fresh start's first event->first step, and in-process over relaunch.
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


def _after_restart(events: dict[int, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """Each rank's events from its restart in place on."""
    out = {}
    for r, evs in events.items():
        i = next(i for i, e in enumerate(evs) if e["name"] == "restart_in_process")
        out[r] = evs[i:]
    return out


def in_process_stages(run_dir: Path) -> dict[str, float]:
    ev = _after_restart(_events(run_dir))
    marks = [evs[0] for evs in ev.values()]
    failed = min(m["failed_at"] for m in marks)
    row = {"stop": max(m["report_s"] + m["destroy_s"] + m["agree_s"] for m in marks), "init": _span(ev, "phase:init"),
           "warmup": _span(ev, "phase:warmup"), "setup": _span(ev, "setup"), "load": _span(ev, "resume"),
           "step": _first_step_after(ev, "resume")}
    total = _first_step_end(ev) - failed
    row["other"] = total - sum(row.values())
    row["total"] = total
    return row


def stages(run_dir: Path) -> dict[str, dict[str, float]]:
    from lifecycle.rundir import restarts

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


def _run(world: int, kind: str, mode: str, run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "lifecycle", "run", "--nproc", str(world), f"run.dir={run_dir}", *KINDS[kind],
           "train.steps=10", "checkpoint.every_steps=5", "restart.max_restarts=1", f"restart.mode={mode}",
           "+faults=[{at: train, step: 7, ranks: [1], action: raise, attempts: [1]}]"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--kind", choices=sorted(KINDS), default="synthetic")
    args = parser.parse_args()
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            _run(world, args.kind, "relaunch", Path(tmp) / "relaunch")
            got = stages(Path(tmp) / "relaunch")
            _run(world, args.kind, "in_process", Path(tmp) / "in_process")
            got["in process"] = in_process_stages(Path(tmp) / "in_process")
        print(f"\nworld {world} ({args.kind}): seconds per stage, slowest rank")
        print(f"  {'':<11}" + "".join(f"{k:>9}" for k in got["attempt 1"]))
        for name, row in got.items():
            print(f"  {name:<11}" + "".join(f"{v:>9.2f}" for v in row.values()))
        fresh, relaunch, inproc = (got[k]["total"] for k in ("attempt 1", "attempt 2", "in process"))
        print(f"  relaunch / fresh start: {relaunch:.2f} / {fresh:.2f} = {relaunch / fresh:.2f}; in-process / fresh "
              f"start: {inproc / fresh:.2f}; in-process / relaunch: {inproc:.2f} / {relaunch:.2f} = "
              f"{inproc / relaunch:.2f}")

if __name__ == "__main__":
    main()
