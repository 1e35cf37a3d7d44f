"""Generated failures for ``lifecycle diagnose`` at scale: N cases (default 10^6) from tests/unit/diagnose/failures.py,
on as many worker processes as there are CPUs; prints the wrong verdicts (must be 0) and the decided share per fault
x evidence class, and a few cases at worlds 128-1024 with their time.

    .venv/bin/python bench/diagnose_generated.py [N] [--big K]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.unit.diagnose.failures import check  # noqa: E402


def run_range(bounds: tuple[int, int, bool]) -> tuple[list[tuple[int, str]], Counter[tuple[str, str]],
                                                      Counter[tuple[str, str]], float]:
    start, stop, big = bounds
    wrong, seen, decided = [], Counter[tuple[str, str]](), Counter[tuple[str, str]]()
    slowest = 0.0
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        for seed in range(start, stop):
            t0 = time.monotonic()
            out = check(seed, Path(tmp) / "case", big=big)
            slowest = max(slowest, time.monotonic() - t0)
            key = (out.case.fault, out.case.evidence.split(", logs")[0])
            seen[key] += 1
            decided[key] += out.decided
            if out.wrong:
                wrong.append((seed, f"{out.case.fault} culprit {out.case.culprit} named {out.culprits}"))
    return wrong, seen, decided, slowest


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else 1_000_000
    big = int(sys.argv[sys.argv.index("--big") + 1]) if "--big" in sys.argv else 20
    workers = os.cpu_count() or 1
    chunk = max(n // (workers * 8), 1)
    t0 = time.monotonic()
    parts = [(s, min(s + chunk, n), False) for s in range(0, n, chunk)]
    parts += [(10**9 + s, 10**9 + s + 1, True) for s in range(big)]
    wrong, seen, decided = [], Counter[tuple[str, str]](), Counter[tuple[str, str]]()
    slowest_big = 0.0
    with ProcessPoolExecutor(workers) as pool:
        for (w, s, d, slow), part in zip(pool.map(run_range, parts), parts, strict=True):
            wrong += w
            seen += s
            decided += d
            if part[2]:
                slowest_big = max(slowest_big, slow)
    print(f"{n} cases + {big} at worlds 128-1024 in {time.monotonic() - t0:.0f} s on {workers} processes; "
          f"wrong: {len(wrong)}; slowest big case {slowest_big:.1f} s")
    for item in wrong[:20]:
        print("  WRONG", item)
    print("decided share per fault x evidence class (cases):")
    for key in sorted(seen):
        print(f"  {key[0]:14s} {key[1]:34s} {decided[key] / seen[key]:6.1%}  ({seen[key]})")


if __name__ == "__main__":
    main()
