"""Per-step throughput of `lifecycle run` vs a bare megatron-core loop with the same model, schedule and optimizer.

    OMP_NUM_THREADS=1 .venv/bin/python bench/megatron_throughput.py [--reps 5] [--config moe|moe2|pipeline]

Both sides train the same megatron-core model from :mod:`lifecycle.backends.megatron.model` (``build`` then
``train_step``: Megatron's schedule, DDP and optimizer) on the same world size, layout and synthetic batches:

- lifecycle: ``lifecycle run --nproc W`` (its own launcher, orchestrator, watchdog thread, events, warmup,
  the per-step stop-flag all-reduce, DDP collective spans), no checkpoints;
- bare: the same ranks started by ``tests._dist.run_ranks`` (spawn), ``initialize_model_parallel``, ``build``
  and a plain ``for`` loop of ``train_step`` — no orchestrator, watchdog, events or stop-flag agreement.

Per-step time = (end of step N - end of step K) / (N - K) on rank 0 (K skips the first steps: the first
batch of an overlapped DDP, lazy connections). Repetitions alternate the order (lifecycle first, then bare
first). Reported: steps/s of each, the ratio lifecycle/bare per repetition, its median and spread.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests._dist import init_gloo, run_ranks  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    # The default job's model (preset=moe): pp=1, ep2, plain DDP and optimizer.
    "moe": {"world": 4, "parallel": {"ep": 2}, "options": {}},
    # The same model on 2 ranks (ep2): one rank per core on a 2-core machine, so neither side is oversubscribed
    # and the operating system's scheduling of 4 processes on 2 cores does not decide the comparison.
    "moe2": {"world": 2, "parallel": {"ep": 2}, "options": {}},
    # As large MoE jobs train: pp2 with 4 micro-batches, the distributed optimizer, overlapped reduce/gather.
    "pipeline": {"world": 4, "parallel": {"pp": 2, "ep": 2},
                 "options": {"num_layers": 4, "num_microbatches": 4, "use_distributed_optimizer": True,
                             "overlap_grad_reduce": True, "overlap_param_gather": True}},
}


def _overrides(cfg: dict[str, Any], steps: int, extra: list[str]) -> list[str]:
    out = [f"parallelism.{k}={v}" for k, v in cfg["parallel"].items()]
    out += [f"train.options.{k}={json.dumps(v)}" for k, v in cfg["options"].items()]
    return [*out, f"train.steps={steps}", "checkpoint.every_steps=0", "checkpoint.at_end=false", *extra]


GAPS: list[float] = []
"""Per lifecycle run: the median time between the end of a step and the begin of the next one on rank 0 (the
step boundary: stop-flag all-reduce, drills, progress, events), as a fraction of the median step period."""
INSIDE: dict[str, list[float]] = {"lifecycle": [], "bare": []}
"""Per run: the median time of one step itself on rank 0 (lifecycle: the `step` span; bare: one train_step)."""


def _lifecycle(cfg: dict[str, Any], steps: int, skip: int, extra: list[str]) -> float:
    from lifecycle.obs.events import read_events

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "lifecycle", "run", "--nproc", str(cfg["world"]), f"run.dir={run_dir}",
               *_overrides(cfg, steps, extra)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
        events = read_events(run_dir)[0]
    ends = {e["step"]: e["t"] / 1e6 for e in events if e["name"] == "step" and e["kind"] == "end"}
    begins = {e["step"]: e["t"] / 1e6 for e in events if e["name"] == "step" and e["kind"] == "begin"}
    period = (ends[steps] - ends[skip]) / (steps - skip)
    GAPS.append(statistics.median(begins[k + 1] - ends[k] for k in range(skip, steps)) / period)
    INSIDE["lifecycle"].append(statistics.median(ends[k] - begins[k] for k in range(skip + 1, steps + 1)))
    return period


def _bare_rank(rank: int, world: int, cfg: dict[str, Any], steps: int, skip: int) -> tuple[float, float]:
    import warnings

    warnings.simplefilter("ignore")
    init_gloo(rank, world, timeout_s=300)
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron import model as m
    from lifecycle.backends.megatron import parallel
    from lifecycle.policy.options import MegatronGPTOptions

    parallel.initialize(**cfg["parallel"], timeout_s=300)
    from lifecycle.policy.sections import RunConfig

    spec = m.ModelSpec(MegatronGPTOptions(**cfg["options"]), seed=RunConfig().seed)
    state = m.build(spec)
    dp_rank = ps.get_data_parallel_rank()
    ends: dict[int, float] = {}
    begins: dict[int, float] = {}
    for step in range(1, steps + 1):  # the same batches as `lifecycle run` (steps count from 1)
        begins[step] = time.perf_counter()
        m.train_step(state, m.step_batches(spec, step, dp_rank))
        ends[step] = time.perf_counter()
    parallel.destroy()
    inside = statistics.median(ends[k] - begins[k] for k in range(skip + 1, steps + 1))
    return (ends[steps] - ends[skip]) / (steps - skip), inside


def _bare(cfg: dict[str, Any], steps: int, skip: int) -> float:
    period, inside = run_ranks(_bare_rank, cfg["world"], 600, cfg, steps, skip, env={"OMP_NUM_THREADS": "1"})[0]
    INSIDE["bare"].append(inside)
    return float(period)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="moe")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--set", action="append", default=[], help="extra override for the lifecycle side")
    args = parser.parse_args()
    cfg = CONFIGS[args.config]
    life: list[float] = []
    bare: list[float] = []
    for rep in range(args.reps):
        order = ("lifecycle", "bare") if rep % 2 == 0 else ("bare", "lifecycle")
        for side in order:
            if side == "lifecycle":
                life.append(_lifecycle(cfg, args.steps, args.skip, args.set))
            else:
                bare.append(_bare(cfg, args.steps, args.skip))
        print(f"rep {rep}: lifecycle {1 / life[-1]:.2f} steps/s, bare {1 / bare[-1]:.2f} steps/s, "
              f"ratio {bare[-1] / life[-1]:.3f}", flush=True)
    ratios = [b / lf for lf, b in zip(life, bare, strict=True)]
    print(f"\nconfig {args.config} (world {cfg['world']}, {cfg['parallel']}, {cfg['options']}), steps "
          f"{args.skip + 1}..{args.steps}, {args.reps} interleaved repetitions, extra {args.set}")
    print("| | median steps/s | repetitions |\n|---|---|---|")
    print(f"| bare megatron-core loop (baseline) | {statistics.median(1 / t for t in bare):.2f} | "
          + ", ".join(f"{1 / t:.2f}" for t in bare) + " |")
    print(f"| lifecycle run | {statistics.median(1 / t for t in life):.2f} | "
          + ", ".join(f"{1 / t:.2f}" for t in life) + " |")
    print(f"| **ratio lifecycle/bare** | **{statistics.median(ratios):.3f}** (min {min(ratios):.3f}, max "
          f"{max(ratios):.3f}) | " + ", ".join(f"{r:.3f}" for r in ratios) + " |")
    print(f"| lifecycle step boundary / step period | {statistics.median(GAPS):.4f} | "
          + ", ".join(f"{g:.4f}" for g in GAPS) + " |")
    inside = [lf / b for lf, b in zip(INSIDE["lifecycle"], INSIDE["bare"], strict=True)]
    print(f"| step itself, lifecycle/bare (median step time) | {statistics.median(inside):.3f} | "
          + ", ".join(f"{r:.3f}" for r in inside) + " |")


if __name__ == "__main__":
    main()
