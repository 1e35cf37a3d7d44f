"""Wall time of `lifecycle validate` and `lifecycle explain --world-size 16384`, against the bare interpreter.

    .venv/bin/python bench/cli_speed.py [--reps 5]

Each command runs as a fresh subprocess (what a user waits for); the baseline is `python -c pass` measured in the
same run, so the ratio is stable across machines. Goals (issue 2): validate < 0.5 s, explain at 16384 ranks < 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "baseline: python -c pass": [sys.executable, "-c", "pass"],
    "lifecycle validate": [sys.executable, "-m", "lifecycle", "validate"],
    "lifecycle explain --world-size 16384 (moe_large, tp8 ep8)": [
        sys.executable, "-m", "lifecycle", "explain", "--world-size", "16384", "--rank", "12345",
        "preset=moe_large", "parallelism.tp=8", "train.options.heads=8", "parallelism.ep=8"],
}


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    results = {}
    for name, cmd in CASES.items():
        wall(cmd)  # warm the page cache
        results[name] = statistics.median(wall(cmd) for _ in range(args.reps))
    base = results["baseline: python -c pass"]
    print(f"| command | median wall (s), {args.reps} runs | x baseline |")
    print("|---|---|---|")
    for name, t in results.items():
        print(f"| {name} | {t:.3f} | {t / base:.1f} |")


if __name__ == "__main__":
    main()
