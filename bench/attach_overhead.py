"""What adopting lifecycle costs a trainer's own loop: the same megatron-core GPT-MoE loop bare vs adopted.

The loop is examples/own_loop/megatron_core_loop.py's (its model, its step). "bare" runs it with nothing of
lifecycle; "adopted" with ``attach`` + ``watch`` + ``job.steps`` (warmup, watchdog, step spans, the overlapped
stop-flag all-reduce at every boundary, DDP bucket spans; checkpoints off so that both loops do the same work).
Per-step time is the median of rank 0's steps after the first two. Launches alternate bare/adopted, ``--rounds``
of each per world size, and the ratio is bare/adopted (1.0: free; goal >= 0.99). ``adopted-sparse`` agrees the
stop flag every 10 steps (``checkpoint.signal_check_every=10``) instead of every step::

    python bench/attach_overhead.py --worlds 2 4 --steps 40 --rounds 5 --modes bare adopted adopted-sparse
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_loop" / "megatron_core_loop.py"
MODES = ["bare", "adopted", "adopted-sparse"]


def _example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("own_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(mode: str, steps: int, out: Path, run_dir: str) -> None:
    """One rank (under torchrun): the example's loop, bare or adopted; rank 0 writes its step times."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat

    ex = _example()
    apply_cpu_compat()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    args = argparse.Namespace(tp=1, ep=2)
    times: list[float] = []
    if mode == "bare":
        model, optimizer, _ = ex.build(args)
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            ex.train_step(model, optimizer, step)
            now = time.perf_counter()
            times.append(now - t0)
            t0 = now
        dist.barrier()
        dist.destroy_process_group()
    else:
        import lifecycle

        sparse = ["checkpoint.signal_check_every=10"] if mode == "adopted-sparse" else []
        with lifecycle.attach(overrides=["parallelism.ep=2", f"run.dir={run_dir}", "checkpoint.every_steps=0",
                                         "checkpoint.at_end=false", *sparse]) as job:
            model, optimizer, _ = ex.build(args)
            job.watch(model, optimizer)
            t0 = time.perf_counter()
            for step in job.steps(steps):
                job.report(loss=ex.train_step(model, optimizer, step))
                now = time.perf_counter()  # the boundary of the step before is inside this interval
                times.append(now - t0)
                t0 = now
    if os.environ.get("RANK") == "0":
        out.write_text(json.dumps(times))


def launch(mode: str, world: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               __file__, "--worker", mode, "--steps", str(steps), "--out", str(out), "--run-dir", f"{tmp}/run"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"{mode} at world {world} failed:\n{proc.stderr[-3000:]}")
        times = json.loads(out.read_text())[2:]
        return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", choices=MODES)
    p.add_argument("--modes", nargs="+", choices=MODES, default=["bare", "adopted"])
    p.add_argument("--out", type=Path)
    p.add_argument("--run-dir", default="")
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.steps, a.out, a.run_dir)
        return
    results: dict[int, dict[str, object]] = {}
    for world in a.worlds:
        runs: dict[str, list[float]] = {m: [] for m in a.modes}
        for _ in range(a.rounds):  # interleaved: drift on the machine hits every mode alike
            for mode in a.modes:
                runs[mode].append(launch(mode, world, a.steps))
        med = {m: statistics.median(v) for m, v in runs.items()}
        row: dict[str, object] = {f"{m}_ms": round(v * 1e3, 2) for m, v in med.items()}
        row.update({f"ratio_{m}": round(med["bare"] / v, 3) for m, v in med.items() if m != "bare"})
        row["runs_ms"] = {m: [round(x * 1e3, 2) for x in v] for m, v in runs.items()}
        results[world] = row
        print(f"world {world}: " + ", ".join(f"{m} {v * 1e3:.1f} ms/step" for m, v in med.items()) + "; "
              + ", ".join(f"bare/{m} {med['bare'] / v:.3f}" for m, v in med.items() if m != "bare"), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
