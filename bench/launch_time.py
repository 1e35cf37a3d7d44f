"""End-to-end time of one `lifecycle run` from two source trees, side by side: the launch a user waits for, a
preemption's relaunch (a new `lifecycle run`) and every launch of the test suite.

    OMP_NUM_THREADS=1 .venv/bin/python bench/launch_time.py --baseline /tmp/wt-old [--rounds 3] [--kind megatron]

Each round runs the same command from the baseline tree and from this one (``PYTHONPATH`` picks the tree, the same
virtual environment for both), alternating which goes first. The command: the default job (``--kind megatron``: the
Megatron MoE GPT, world 4) or the synthetic kind, ``train.steps=2``, its end-of-job picture included (the policy's
default). Reported per tree: the wall time from the command's start to its exit, and goodput's start-up bucket from
the run's summary; the ratio is this tree's over the baseline's, per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"megatron": [], "synthetic": ["train.kind=synthetic", "~train.options", "moe.zero_token.action=off",
                                       "parallelism.ep=1"]}


def _once(tree: Path, kind: str, folder: Path) -> tuple[float, float]:
    run_dir = folder / f"run-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lifecycle", "run", "--nproc", "4", f"run.dir={run_dir}",
                           "train.steps=2", *KINDS[kind]], capture_output=True, text=True, env=env, cwd=tree,
                          timeout=300)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return wall, float(summary["goodput"]["buckets_s"]["startup"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the other source tree (a git worktree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kind", choices=sorted(KINDS), default="megatron")
    args = p.parse_args()
    trees = {"baseline": Path(args.baseline).resolve(), "this": ROOT}
    walls: dict[str, list[float]] = {k: [] for k in trees}
    starts: dict[str, list[float]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory(prefix="launch-time-") as tmp:
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                wall, startup = _once(trees[name], args.kind, Path(tmp))
                walls[name].append(wall)
                starts[name].append(startup)
                print(f"round {r + 1} {name:8s} wall {wall:6.2f} s  start-up {startup:5.2f} s", flush=True)
    ratios = [a / b for a, b in zip(walls["this"], walls["baseline"], strict=True)]
    for name in trees:
        print(f"{name:8s} wall median {statistics.median(walls[name]):.2f} s, start-up median "
              f"{statistics.median(starts[name]):.2f} s")
    print(f"this / baseline wall, per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
