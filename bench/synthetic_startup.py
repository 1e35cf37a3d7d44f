"""Wall time of a 4-rank synthetic drill: groups made with torch.distributed (the synthetic kind) vs megatron's.

    OMP_NUM_THREADS=1 .venv/bin/python bench/synthetic_startup.py [--reps 5]

Both sides run `lifecycle run --nproc 4` with the same policy (tp2, 4 steps, a checkpoint every 2 steps). The
baseline is the very same step handler registered through the `lifecycle.handlers` entry-point group as a kind
`synthetic_megatron` with `HandlerSpec.groups="megatron"` (a temporary dist-info folder on PYTHONPATH), so the only
difference is who makes the model-parallel groups: megatron-core's `initialize_model_parallel` (importing
megatron) or `lifecycle.distributed.native`. Repetitions alternate the two; the ratio is per back-to-back pair.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICY = ["~train.options", "moe.zero_token.action=off", "parallelism.ep=1", "parallelism.tp=2", "train.steps=4",
          "checkpoint.every_steps=2"]
SPEC = '''from lifecycle.policy.options import SyntheticOptions
from lifecycle.policy.registry import HandlerSpec

SPECS = [HandlerSpec("synthetic_megatron", "train", SyntheticOptions, "lifecycle.backends.synthetic:SyntheticStep",
                     "the synthetic kind on megatron's groups (bench baseline)", groups="megatron")]
'''


def _baseline_kind(folder: Path) -> None:
    (folder / "bench_megatron_groups.py").write_text(SPEC)
    info = folder / "bench_megatron_groups-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bench-megatron-groups\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[lifecycle.handlers]\nbench = bench_megatron_groups:SPECS\n")


def _run(kind: str, tmp: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds of the whole command, init phase median over ranks)."""
    import json

    run_dir = tmp / f"run-{kind}-{time.monotonic_ns()}"
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "lifecycle", "run", "--nproc", "4", f"run.dir={run_dir}",
                    f"train.kind={kind}", *POLICY], check=True, capture_output=True, timeout=300, env=env, cwd=ROOT)
    wall = time.monotonic() - t0
    return wall, json.loads((run_dir / "summary.json").read_text())["phases"]["init"]["median_s"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    reps = parser.parse_args().reps
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        _baseline_kind(tmp)
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(tmp), os.environ.get("PYTHONPATH", "")) if p)}
        torch_side, megatron_side = [], []
        for rep in range(reps):
            pair = [("synthetic", torch_side), ("synthetic_megatron", megatron_side)]
            for kind, out in pair if rep % 2 == 0 else pair[::-1]:
                out.append(_run(kind, tmp, env))
    ratios = [a[0] / b[0] for a, b in zip(torch_side, megatron_side, strict=True)]
    print("| groups | wall (s): median (min, max) | init phase, median over ranks (s) |")
    print("|---|---|---|")
    for label, side in (("torch.distributed (synthetic)", torch_side), ("baseline: megatron", megatron_side)):
        walls, inits = [w for w, _ in side], [i for _, i in side]
        print(f"| {label} | {statistics.median(walls):.2f} ({min(walls):.2f}, {max(walls):.2f}) | "
              f"{statistics.median(inits):.2f} |")
    print(f"\nwall ratio torch/megatron per pair: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {reps} pairs")


if __name__ == "__main__":
    main()
