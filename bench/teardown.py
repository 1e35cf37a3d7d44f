"""Clean teardown at world 8 with every Megatron group (tp2 pp2 ep2), ordered vs without the barrier.

    OMP_NUM_THREADS=1 .venv/bin/python bench/teardown.py

Runs `lifecycle run --nproc 8 train.steps=0` (init -> warmup of every group -> teardown) twice: the policy's
ordered teardown (store barrier, finalize, destroy model-parallel state, destroy subgroups newest first,
destroy the default group) and `teardown=fast` (the same without the barrier) as the baseline. Reports the
teardown phase time over ranks from summary.json. Goal (issue 3): ordered teardown <= 2 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUT = ["parallelism.tp=2", "parallelism.pp=2", "parallelism.ep=2", "train.steps=0", "warmup.groups=all"]


def teardown_times(extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "lifecycle", "run", "--nproc", "8", f"run.dir={run_dir}", *LAYOUT,
                        *extra], check=True, capture_output=True, timeout=300)
        return json.loads((run_dir / "summary.json").read_text())["phases"]["teardown"]


def main() -> None:
    ordered = teardown_times([])
    fast = teardown_times(["teardown=fast"])
    print("| teardown (world 8, tp2 pp2 ep2) | min (s) | median (s) | max (s) |")
    print("|---|---|---|---|")
    for name, t in (("ordered (policy default)", ordered), ("baseline: teardown=fast, no barrier", fast)):
        print(f"| {name} | {t['min_s']:.3f} | {t['median_s']:.3f} | {t['max_s']:.3f} |")
    print(f"\nratio ordered/baseline (max over ranks): {ordered['max_s'] / max(fast['max_s'], 1e-6):.2f}")


if __name__ == "__main__":
    main()
