"""lifecycle's own per-step work in a trainer's loop, timed directly, beside the end-to-end adopted/bare ratio.

The loop is examples/own_loop/megatron_core_loop.py's (its GPT-MoE, its step; EP=2, gloo, checkpoints off), adopted
with ``attach`` + ``watch`` + ``for step in job.steps(n)``. Every rank times, per step, with ``time.perf_counter``:

- the trainer's step (``train_step``), less the lifecycle hooks that run inside it;
- lifecycle's per-step code on the training thread: everything between the end of the loop body of step k and the
  start of the body of step k+1 (the step span's end, the boundary: stop flag read/issue, barrier points, cadence
  checks, the next step span's begin: drills, events, the zero-token guard's step), plus ``job.report`` and the
  hooks inside the step: the DDP bucket spans (``comm_events``: span begin/end, labels, op counts) and the
  zero-token guard's forward hooks;
- the training thread's CPU time in the same between-steps gap (``time.thread_time``: preemption by other
  processes on a loaded machine is not in it);
- the CPU time of the threads ``attach`` started (the watchdog, its store I/O threads).

Modes: ``overlapped`` (the default policy: the stop flag every step, issued at a boundary and read at the next),
``at-once`` (``checkpoint.signal_overlap=false``: issued and read at each boundary), ``no-flag``
(``checkpoint.on_signal=false``: no stop flag), ``plain`` (the default without the wrappers).

Except ``plain``, the workers wrap lifecycle's functions with perf_counter accumulators before ``attach``
(measurement only, nothing of the product changes) to split that time into its parts; ``plain`` only times the
loop body (its gap is the total without the wrappers' own cost). Steps 2..N-1 are the steady state; step 1
(traced: which communicators it uses) and step N (its stop flag is agreed at once) are shown apart.
``--rounds`` bare/adopted launches of bench/attach_overhead.py give the end-to-end ratio beside it::

    OMP_NUM_THREADS=1 python bench/step_cost.py --worlds 2 4 --steps 100 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attach_overhead  # noqa: E402 - the end-to-end bench and the example's loader

MODES = {"plain": [], "overlapped": [], "at-once": ["checkpoint.signal_overlap=false"],
         "no-flag": ["checkpoint.on_signal=false"]}
"""Launch modes: the policy overrides on top of the default (stop flag every step, overlapped)."""
ACC: defaultdict[str, float] = defaultdict(float)
"""Seconds (and counts, keys ending in _n) accumulated by the probes since the last take()."""
MAIN = threading.get_ident()


def take() -> dict[str, float]:
    out = dict(ACC)
    ACC.clear()
    return out


def timed(fn: Callable[..., Any], key: str, main_only: bool = False) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if main_only and threading.get_ident() != MAIN:
            return fn(*args, **kwargs)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ACC[key] += time.perf_counter() - t
            ACC[key + "_n"] += 1

    return wrapper


class TimedCM:
    """A context manager made by ``make()``: the time to make and enter it goes to ``enter``, to exit it ``leave``."""

    def __init__(self, make: Callable[[], Any], enter: str, leave: str) -> None:
        self.make, self.enter, self.leave = make, enter, leave

    def __enter__(self) -> Any:
        t = time.perf_counter()
        self.cm = self.make()
        try:
            return self.cm.__enter__()
        finally:
            ACC[self.enter] += time.perf_counter() - t
            ACC[self.enter + "_n"] += 1

    def __exit__(self, *exc: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.cm.__exit__(*exc)
        finally:
            ACC[self.leave] += time.perf_counter() - t


def probe_lifecycle() -> None:
    """Before attach: the step span, the boundary, the stop flag, every event (training thread), the guard's hooks."""
    from lifecycle.moe.zero_token import ZeroTokenGuard
    from lifecycle.obs.events import EventLog
    from lifecycle.phases import train

    step = train.StepLoop.step
    train.StepLoop.step = lambda self, ctx, n: TimedCM(lambda: step(self, ctx, n), "step_enter", "step_exit")
    train.StepLoop.boundary = timed(train.StepLoop.boundary, "boundary")
    train.StopFlag.__init__ = timed(train.StopFlag.__init__, "flag_issue")
    train.StopFlag.read = timed(train.StopFlag.read, "flag_read")
    train.agree_stop = timed(train.agree_stop, "flag_at_once")
    EventLog.emit = timed(EventLog.emit, "emit", main_only=True)
    ZeroTokenGuard._before = timed(ZeroTokenGuard._before, "zero_token")
    ZeroTokenGuard._after = timed(ZeroTokenGuard._after, "zero_token")


def _swap_cell(fn: Callable[..., Any], name: str, new: Callable[[Any], Any]) -> None:
    """Replace the closure variable ``name`` of ``fn`` (lifecycle's wrapper) by ``new(old)``."""
    cell = fn.__closure__[fn.__code__.co_freevars.index(name)]  # type: ignore[index]
    cell.cell_contents = new(cell.cell_contents)


def probe_ddp() -> None:
    """After watch: lifecycle's wrappers of megatron DDP's coalescing manager and bucket methods, each timed outside
    and its wrapped original inside (the difference is lifecycle's, the collectives themselves excluded)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    recorded = pgb._coalescing_manager
    assert getattr(recorded, "_lifecycle", False), "lifecycle's DDP recorder is not installed"
    _swap_cell(recorded.__wrapped__, "manager",
               lambda m: lambda *a, **k: TimedCM(lambda: m(*a, **k), "ddp_span_inner", "ddp_span_inner"))
    pgb._coalescing_manager = lambda *a, **k: TimedCM(lambda: recorded(*a, **k), "ddp_span_outer", "ddp_span_outer")
    for method in ("start_grad_sync", "start_param_sync"):
        named = getattr(pgb._ParamAndGradBucketGroup, method)
        _swap_cell(named, "method", lambda m: timed(m, "ddp_named_inner"))
        setattr(pgb._ParamAndGradBucketGroup, method, timed(named, "ddp_named_outer"))


def probe_cost(n: int = 20000) -> float:
    """Seconds one timed() wrapper adds to a call (what the split into parts costs itself)."""

    def noop() -> None:
        return None

    wrapped = timed(noop, "_calibration")
    best = []
    for fn in (noop, wrapped):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n)
    ACC.clear()
    return best[1] - best[0]


def cpu_s(threads: list[threading.Thread]) -> float:
    total = 0.0
    for t in threads:
        with contextlib.suppress(OSError, TypeError, ProcessLookupError):
            total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))  # type: ignore[arg-type]
    return total


def worker(mode: str, steps: int, out: Path, run_dir: str) -> None:
    """One rank (under torchrun): the adopted loop; every rank writes its per-step times to ``out/rank_R.json``."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import lifecycle
    from lifecycle.backends.megatron.cpu_compat import apply_cpu_compat

    ex = attach_overhead._example()
    apply_cpu_compat()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    if mode != "plain":
        probe_lifecycle()
    before = set(threading.enumerate())
    overrides = ["parallelism.ep=2", f"run.dir={run_dir}", "checkpoint.every_steps=0", "checkpoint.at_end=false",
                 *MODES[mode]]
    rows: list[dict[str, Any]] = []
    with lifecycle.attach(overrides=overrides) as job:
        threads = [t for t in threading.enumerate() if t not in before]
        model, optimizer, _ = ex.build(argparse.Namespace(tp=1, ep=2))
        job.watch(model, optimizer)
        if mode != "plain":
            probe_ddp()
        take()
        cpu0 = cpu_s(threads)
        t_out, c_out = time.perf_counter(), time.thread_time()
        for step in job.steps(steps):
            t_in, c_in = time.perf_counter(), time.thread_time()
            if rows:
                rows[-1].update(between=t_in - t_out, between_cpu=c_in - c_out, b=take())
            else:
                first = {"gap": t_in - t_out, "b": take()}
            loss = ex.train_step(model, optimizer, step)
            t_mid = time.perf_counter()
            job.report(loss=loss)
            t_out, c_out = time.perf_counter(), time.thread_time()
            rows.append({"step": step, "t_in": t_in, "body": t_mid - t_in, "report": t_out - t_mid, "i": take()})
        rows[-1].update(between=time.perf_counter() - t_out, between_cpu=time.thread_time() - c_out, b=take())
        cpu = cpu_s(threads) - cpu0
    names = sorted({t.name for t in threads})
    out.joinpath(f"rank_{dist.get_rank()}.json").write_text(json.dumps(
        {"rows": rows, "first": first, "threads": names, "thread_cpu_s": cpu, "probe_s": probe_cost()}))
    dist.destroy_process_group()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def inside(i: dict[str, float]) -> float:
    """Lifecycle's time inside the trainer's step: DDP wrapper overhead and the zero-token guard's hooks."""
    return (i.get("ddp_span_outer", 0) - i.get("ddp_span_inner", 0) + i.get("ddp_named_outer", 0)
            - i.get("ddp_named_inner", 0) + i.get("zero_token", 0))


def summarize(ranks: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    us = 1e6
    steady, first, last, trainer, interval, gap, gap_cpu, in_step = [], [], [], [], [], [], [], []
    by_rank: list[float] = []
    parts: defaultdict[str, list[float]] = defaultdict(list)
    counts: defaultdict[str, list[float]] = defaultdict(list)
    for data in ranks:
        rows = data["rows"]
        mine = len(steady)
        for k, r in enumerate(rows):
            own = r["between"] + r["report"] + inside(r["i"])
            (first if r["step"] == 1 else last if r["step"] == steps else steady).append(own)
            if r["step"] == 1:
                first[-1] += data["first"]["gap"]
            if r["step"] in (1, steps):
                continue
            trainer.append(r["body"] - inside(r["i"]))
            gap.append(r["between"] + r["report"])
            gap_cpu.append(r["between_cpu"])
            in_step.append(inside(r["i"]))
            interval.append(rows[k + 1]["t_in"] - r["t_in"])
            b, i = r["b"], r["i"]
            for key in ("step_exit", "boundary", "flag_read", "flag_issue", "flag_at_once", "step_enter"):
                parts[key].append(b.get(key, 0))
            parts["report"].append(r["report"])
            parts["ddp_spans"].append(i.get("ddp_span_outer", 0) - i.get("ddp_span_inner", 0))
            parts["ddp_named"].append(i.get("ddp_named_outer", 0) - i.get("ddp_named_inner", 0))
            parts["zero_token"].append(i.get("zero_token", 0))
            parts["emit"].append(b.get("emit", 0) + i.get("emit", 0))
            counts["events"].append(b.get("emit_n", 0) + i.get("emit_n", 0))
            counts["ddp_spans"].append(i.get("ddp_span_outer_n", 0))
            parts["rest"].append(r["between"] - b.get("step_exit", 0) - b.get("boundary", 0) - b.get("step_enter", 0))
        by_rank.append(statistics.median(steady[mine:]))
    med_interval = statistics.median(interval)
    own = {"p50": pct(steady, 50), "p99": pct(steady, 99), "max": max(steady)}
    return {
        "samples": len(steady),
        "trainer_step_ms": round(statistics.median(trainer) * 1e3, 2),
        "interval_ms": round(med_interval * 1e3, 2),
        "own_us": {k: round(v * us, 1) for k, v in own.items()},
        "own_pct_of_step": {k: round(100 * v / med_interval, 3) for k, v in own.items()},
        "own_mean_us": round(statistics.fmean(steady) * us, 1),
        "own_p50_by_rank_us": [round(v * us, 1) for v in by_rank],
        "between_steps_p50_us": round(statistics.median(gap) * us, 1),
        "between_steps_cpu_p50_us": round(statistics.median(gap_cpu) * us, 1),
        "in_step_p50_us": round(statistics.median(in_step) * us, 1),
        "step1_us_max": round(max(first) * us),
        "last_step_us_max": round(max(last) * us),
        "parts_p50_us": {k: round(statistics.median(v) * us, 1) for k, v in parts.items()},
        "per_step_counts_p50": {k: statistics.median(v) for k, v in counts.items()},
        "probe_us_per_call": round(max(d["probe_s"] for d in ranks) * us, 2),
        "threads": ranks[0]["threads"],
        "thread_cpu_us_per_step": round(max(d["thread_cpu_s"] for d in ranks) / steps * us, 1),
    }


def launch(mode: str, world: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               __file__, "--worker", mode, "--steps", str(steps), "--out", tmp, "--run-dir", f"{tmp}/run"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"{mode} at world {world} failed:\n{proc.stderr[-3000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank_*.json"))]
        assert len(ranks) == world, f"{len(ranks)} of {world} ranks wrote their times"
        return summarize(ranks, steps)


def ratio(world: int, steps: int, rounds: int) -> dict[str, Any]:
    """bench/attach_overhead.py's launches, alternating bare/adopted: rank 0's median ms/step per launch."""
    runs: dict[str, list[float]] = {"bare": [], "adopted": []}
    for _ in range(rounds):
        for mode in runs:
            runs[mode].append(attach_overhead.launch(mode, world, steps))
    med = {m: statistics.median(v) for m, v in runs.items()}
    per_round = [b / a for b, a in zip(runs["bare"], runs["adopted"], strict=True)]
    return {"runs_ms": {m: [round(x * 1e3, 2) for x in v] for m, v in runs.items()},
            "bare_over_adopted_medians": round(med["bare"] / med["adopted"], 3),
            "bare_over_adopted_minima": round(min(runs["bare"]) / min(runs["adopted"]), 3),
            "per_round": [round(x, 3) for x in per_round]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument(
        "--rounds", type=int, default=3, help="bare/adopted rounds of the end-to-end ratio (0: none)"
    )
    p.add_argument("--ratio-steps", type=int, default=40)
    p.add_argument("--worker", choices=list(MODES))
    p.add_argument("--out", type=Path)
    p.add_argument("--run-dir", default="")
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.steps, a.out, a.run_dir)
        return
    results: dict[str, Any] = {}
    for world in a.worlds:
        for mode in a.modes:
            row = launch(mode, world, a.steps)
            results[f"world {world} {mode}"] = row
            print(f"world {world} {mode}: " + json.dumps(row), flush=True)
        if a.rounds:
            row = ratio(world, a.ratio_steps, a.rounds)
            results[f"world {world} ratio"] = row
            print(f"world {world} ratio: " + json.dumps(row), flush=True)
    print(json.dumps(results))
    table(results)


def table(results: dict[str, Any]) -> None:
    print("| world, mode | trainer step ms | lifecycle per step p50 / p99 / max us | % of step p50 / p99 | "
          "between steps p50 wall / CPU us | in step p50 us | step 1 us | attach's threads CPU us/step |")
    for name, r in results.items():
        if name.endswith("ratio"):
            continue
        o, f = r["own_us"], r["own_pct_of_step"]
        print(f"| {name} | {r['trainer_step_ms']} | {o['p50']:.0f} / {o['p99']:.0f} / {o['max']:.0f} | "
              f"{f['p50']:.2f} / {f['p99']:.2f} | {r['between_steps_p50_us']:.0f} / "
              f"{r['between_steps_cpu_p50_us']:.0f} | {r['in_step_p50_us']:.0f} | {r['step1_us_max']} | "
              f"{r['thread_cpu_us_per_step']:.0f} |")


if __name__ == "__main__":
    main()
