"""Adaptive deadlines and stragglers: detection latency auto vs static, false alarms over a soak, straggler latency.

    OMP_NUM_THREADS=1 .venv/bin/python bench/adaptive.py [--reps 3] [--soak-steps 1000]

All runs: `lifecycle run` on 4 gloo ranks, the synthetic kind at 20 ms + up to 20 ms of seeded jitter per step.
- stall: a `stall` drill on rank 1 at step 300; latency = rank 1's `hang_report` event - the drill's event.
  auto = `deadlines.step=auto` with the default adaptive settings (factor 4, p99, window 200, floor 5 s,
  calibration 20) and with factor 4 / floor 0.3 s; static = `deadlines.step=30` (the default is 600 s: it scales).
- soak: `--soak-steps` steps with auto deadlines (factor 4, floor 0.3 s), checkpoints every 100 steps, a barrier
  every 50: hang reports (false alarms) must be 0.
- straggler: a `slow` drill (+50 ms/step on rank 2 from step 30, window 10, factor 1.5): steps from the drill to
  rank 0's `straggler` event.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed.runs import SYNTHETIC, lifecycle_run  # noqa: E402

BASE = [*SYNTHETIC, "watchdog.deadlines.init=60", "watchdog.deadlines.warmup=20", "watchdog.deadlines.teardown=10",
        "teardown.deadline_s=15", "watchdog.poll_interval_s=0.1", "++train.options.step_sleep_s=0.02",
        "++train.options.step_jitter_s=0.02", "warmup.ops=[barrier]", "checkpoint.every_steps=0"]


def stall(mode: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run = lifecycle_run(Path(tmp), 4, *BASE, *mode, "train.steps=400",
                            "+faults=[{at: train, step: 300, ranks: [1], action: stall}]", timeout=200)
        assert run.code == 3, run.output[-2000:]
        events = run.events()[1]
        drill = next(e["t"] for e in events if e["name"] == "fault_drill")
        report = next(e["t"] for e in events if e["name"] == "hang_report")
        return (report - drill) / 1e6


def soak(steps: int) -> tuple[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run = lifecycle_run(Path(tmp), 4, *BASE, "watchdog.deadlines.step=auto", "watchdog.deadlines.checkpoint=auto",
                            "watchdog.adaptive.floor_s=0.3", f"train.steps={steps}", "checkpoint.every_steps=100",
                            "+barriers.every_n_steps={group: world, n: 50}", timeout=900)
        assert run.code == 0, run.output[-2000:]
        s = run.summary()
        return len(s["hang_reports"]), float(s["deadlines"]["train"]["seconds"])


def straggler() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run = lifecycle_run(Path(tmp), 4, *BASE, "train.steps=100", "watchdog.straggler.window=10",
                            "watchdog.straggler.factor=1.5",
                            "+faults=[{at: train, step: 30, ranks: [2], action: slow, seconds: 0.05}]", timeout=200)
        assert run.code == 0, run.output[-2000:]
        named = [st for st in run.summary()["stragglers"] if st["straggler_rank"] == 2 and not st.get("recovered")]
        return int(named[0]["at_step"]) - 30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--soak-steps", type=int, default=1000)
    args = parser.parse_args()
    modes = {"auto (defaults: factor 4, floor 5 s)": ["watchdog.deadlines.step=auto"],
             "auto (factor 4, floor 0.3 s)": ["watchdog.deadlines.step=auto", "watchdog.adaptive.floor_s=0.3"],
             "static 30 s": ["watchdog.deadlines.step=30"]}
    print("## stall at step 300 on rank 1: drill -> report on rank 1 (s)")
    results: dict[str, list[float]] = {}
    for name, mode in modes.items():
        reps = 1 if name.startswith("static") else args.reps
        results[name] = [stall(mode) for _ in range(reps)]
        print(f"{name:<40} " + " ".join(f"{v:.2f}" for v in results[name])
              + f"   median {statistics.median(results[name]):.2f}", flush=True)
    base = statistics.median(results["static 30 s"])
    for name, vals in results.items():
        print(f"{name:<40} {statistics.median(vals) / base:.3f} x static-30s", flush=True)
    alarms, deadline = soak(args.soak_steps)
    print(f"\n## soak: {args.soak_steps} steps, auto deadlines: false alarms {alarms}, final step deadline "
          f"{deadline:.3f}s", flush=True)
    lags = [straggler() for _ in range(args.reps)]
    print(f"\n## straggler: named {lags} steps after the slow drill started (window 10)", flush=True)


if __name__ == "__main__":
    main()
