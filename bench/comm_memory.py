"""Communicator memory: the model's estimate against what warming each group measured, and what
`warmup.groups: used` saves against `all` — the default job (Megatron GPT-MoE) on gloo at world 4 and 8.

    .venv/bin/python bench/comm_memory.py [--worlds 4 8] [--out bench/comm_memory.json]

Each run is `lifecycle run` with one step and no checkpoint; the figures come from its summary.json (`comm_memory`:
per group the largest measured growth over ranks — resident memory on gloo, device memory outside PyTorch's
allocator on CUDA — beside the estimate for the backend the group really uses). Ratios, not seconds: measured /
estimate per group and for the worst rank's total, and the worst rank's total with `used` / with `all`, measured
in the same invocation.
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

ONE_STEP = ["train.steps=1", "checkpoint.every_steps=0", "checkpoint.at_end=false"]


def run(world: int, groups: str, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "lifecycle", "run", "--nproc", str(world), f"run.dir={tmp}/run",
               f"warmup.groups={groups}", *ONE_STEP, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return dict(json.loads((Path(tmp) / "run" / "summary.json").read_text())["comm_memory"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for world in args.worlds:
        extra = ["parallelism.ep=2"] if world == 4 else ["parallelism.ep=4"]
        full, used = run(world, "all", extra), run(world, "used", extra)
        print(f"\nworld {world} ({' '.join(extra)}), source {full['source']}: per group, largest over ranks")
        print(f"  {'group':<28}{'estimate':>12}{'measured':>12}{'ratio':>8}")
        est_total = 0
        for g, v in full["groups"].items():
            est, got = int(v["estimate_bytes"] or 0), int(v["measured_max_bytes"])
            est_total += est
            ratio = f"{got / est:.2f}" if est else "-"
            print(f"  {g:<28}{est / 1024:>10.0f}Ki{got / 1024:>10.0f}Ki{ratio:>8}")
        total = full["max_total_bytes"]
        print(f"  {'total (worst rank)':<28}{est_total / 1024:>10.0f}Ki{total / 1024:>10.0f}Ki"
              f"{total / max(est_total, 1):>8.2f}")
        print(f"  warmup.groups used / all, worst rank's total: {used['max_total_bytes'] / 1024:.0f} Ki / "
              f"{total / 1024:.0f} Ki = {used['max_total_bytes'] / total:.2f} "
              f"({len(used['groups'])} / {len(full['groups'])} communicators warmed)")
        report[str(world)] = {"all": full, "used": used}
    print("\nNCCL estimate (lifecycle explain --json, distributed.backend=nccl, 8 ranks per node), worst rank:")
    for world, ep in ((16, 4), (64, 4)):
        bills = {}
        for groups in ("all", "used"):
            cmd = [sys.executable, "-m", "lifecycle", "explain", "--json", "--world-size", str(world),
                   "--ranks-per-node", "8", f"parallelism.ep={ep}", "distributed.backend=nccl",
                   f"warmup.groups={groups}"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
            bills[groups] = json.loads(out)["comm_memory"]
        a, u = bills["all"]["total_bytes"], bills["used"]["total_bytes"]
        print(f"  world {world}, ep {ep}: all {a / 2**30:.2f} GiB ({len(bills['all']['communicators'])} "
              f"communicators), used {u / 2**30:.2f} GiB ({len(bills['used']['communicators'])}): used / all "
              f"= {u / a:.2f}")
        report[f"nccl_{world}"] = {g: {"total_bytes": b["total_bytes"], "communicators": len(b["communicators"])}
                                   for g, b in bills.items()}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
