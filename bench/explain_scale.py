"""`lifecycle explain` at any world size, and the CLI on hostile input: wall time and peak memory.

    .venv/bin/python bench/explain_scale.py [--reps 3] [--before DIR]

- scale: `lifecycle explain --json --world-size W --rank R preset=moe_large parallelism.tp=8 parallelism.ep=8`
  for W from 2^14 to 2^30, and 2^31 - 1 (the limit; prime, so tp = ep = 1 there). Goal (issue 11): bounded for
  any world size; report the largest W within 2 s and its peak memory (goal <= 200 MiB).
- hostile: the inputs of issue 11 (alias bomb, 50 MB file, 10,000-deep nesting, a binary file, an interpolation
  bomb, a 100,000-digit integer, a 1,000-part key, a 4,000-character bad value, `explain --world-size 10^8 tp=8`):
  exit code, wall, peak memory and bytes on stderr. Goal: exit 2 within 1 s, <= 200 MiB, no traceback.

Each command is a fresh `python -m lifecycle` subprocess started by a small probe process that reports the
command's own peak RSS (``getrusage(RUSAGE_CHILDREN)``); wall is the median of ``--reps`` runs. ``--before DIR``
also runs every hostile case on another source tree (e.g. ``git archive HEAD | tar -x -C DIR``) with a 20 s and
4 GiB limit, as the baseline of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BAD = ROOT / "tests" / "cli" / "bad_policies"
PROBE = """
import json, resource, subprocess, sys, time
limit_s, limit_mib = float(sys.argv[1]), int(sys.argv[2])
def cap():
    resource.setrlimit(resource.RLIMIT_AS, (limit_mib << 20, limit_mib << 20))
t = time.perf_counter()
try:
    p = subprocess.run(sys.argv[3:], capture_output=True, timeout=limit_s, preexec_fn=cap if limit_mib else None)
    rc, err = p.returncode, p.stderr
except subprocess.TimeoutExpired as exc:
    rc, err = "timeout", exc.stderr or b""
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"rc": rc, "wall_s": wall, "peak_mib": peak, "stderr_bytes": len(err),
                  "traceback": b"Traceback" in err}))
"""
SCALE_ARGS = ["preset=moe_large", "parallelism.tp=8", "train.options.heads=8", "parallelism.ep=8"]


def measure(args: list[str], tree: Path = ROOT, reps: int = 1, limit_s: float = 60, limit_mib: int = 0) -> dict:
    """``python -m lifecycle ARGS`` run ``reps`` times from ``tree``: median wall, max peak, the last rc."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tree)}
    runs = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", PROBE, str(limit_s), str(limit_mib), sys.executable, "-m",
                              "lifecycle", *args], capture_output=True, text=True, env=env, cwd=tree, check=True)
        runs.append(json.loads(out.stdout))
    return {**runs[-1], "wall_s": statistics.median(r["wall_s"] for r in runs),
            "min_s": min(r["wall_s"] for r in runs), "peak_mib": max(r["peak_mib"] for r in runs)}


def scale(reps: int) -> None:
    print(f"| world size | rank | wall (s): median / min of {reps} | peak RSS (MiB) | exit |")
    print("|---|---|---|---|---|")
    worlds = [2**k for k in (14, 17, 20, 24, 27, 30)]
    for world in [*worlds, 2**31 - 1]:
        extra = SCALE_ARGS if world < 2**31 - 1 else ["parallelism.ep=1", "parallelism.tp=1"]
        rank = world - 1
        r = measure(["explain", "--json", "--world-size", str(world), "--rank", str(rank), *extra], reps=reps)
        print(f"| {world:,} | {rank:,} | {r['wall_s']:.3f} / {r['min_s']:.3f} | {r['peak_mib']:.0f} | {r['rc']} |")


def hostile_cases(tmp: Path) -> dict[str, list[str]]:
    (tmp / "big.yaml").write_text("description: " + "x" * (50 << 20) + "\n")
    lines, prev = ["run: {name: x}"], "run.name"
    for i in range(1, 21):
        lines.append(f"l{i}: ${{{prev}}}${{{prev}}}")
        prev = f"l{i}"
    (tmp / "interp.yaml").write_text("\n".join(lines) + "\n")
    return {
        "baseline: validate (default policy)": ["validate"],
        "alias bomb (9 levels x 9 aliases)": ["validate", "-d", str(BAD), "-n", "alias_bomb"],
        "50 MB policy file": ["validate", "-d", str(tmp), "-n", "big"],
        "10,000-deep nesting": ["validate", "-d", str(BAD), "-n", "deep_nesting"],
        "binary file": ["validate", "-d", str(BAD), "-n", "binary"],
        "interpolation bomb (20 doublings)": ["validate", "-d", str(tmp), "-n", "interp"],
        "100,000-digit integer override": ["validate", "train.steps=" + "9" * 100_000],
        "1,000-part override key": ["validate", ".".join(["a"] * 1000) + "=1"],
        "4,000-character bad value": ["validate", "checkpoint.keep_last=" + "x" * 4000],
        "group override checkpoint=5": ["validate", "checkpoint=5"],
        "explain --world-size 2**63": ["explain", "--world-size", str(2**63)],
        "explain --world-size 10^8 parallelism.tp=8 (exit 0)": ["explain", "--world-size", "100000000",
                                                                "parallelism.tp=8", "train.options.heads=8"],
    }


def hostile(reps: int, before: Path | None) -> None:
    head = f"| input | exit | wall (s): median / min of {reps} | peak RSS (MiB) | stderr (bytes) | traceback |"
    print(head + (" before: exit / wall (s) / peak (MiB) / stderr |" if before else ""))
    print("|---" * (6 + bool(before)) + "|")
    with tempfile.TemporaryDirectory() as d:
        for name, args in hostile_cases(Path(d)).items():
            r = measure(args, reps=reps)
            row = (f"| {name} | {r['rc']} | {r['wall_s']:.3f} / {r['min_s']:.3f} | {r['peak_mib']:.0f} | "
                   f"{r['stderr_bytes']} | {'yes' if r['traceback'] else 'no'} |")
            if before:
                b = measure(args, tree=before, limit_s=20, limit_mib=4096)
                tb = ", traceback" if b["traceback"] else ""
                row += (f" {b['rc']}{tb} / {b['wall_s']:.1f} / {b['peak_mib']:.0f} / {b['stderr_bytes']} |")
            print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another source tree to run the hostile cases on")
    parser.add_argument("--what", default="scale,hostile")
    args = parser.parse_args()
    if "scale" in args.what:
        scale(args.reps)
        print()
    if "hostile" in args.what:
        hostile(args.reps, args.before)


if __name__ == "__main__":
    main()
