"""Watchdog costs and latencies.

    OMP_NUM_THREADS=1 .venv/bin/python bench/watchdog.py [--what latency,throughput,barrier] [--reps 3]

- latency: `lifecycle run` on 4 gloo ranks (tp2, synthetic train kind) with a `stall` drill on rank 1 in
  each phase and a 3 s deadline (init: 8 s, it also covers the start-up skew). For every rank: time from
  the first deadline to pass on any rank (a rank's last begin/end event before its report + the deadline)
  to the `hang_report` event on that rank. Goal (issue 5): <= 1 s on every rank. With the default poll
  interval (1 s) and with 0.25 s.
- throughput: the orchestrated train loop (synthetic kind, world 2, 2000 steps, no checkpoints) with
  `watchdog.enabled=true` vs `false`, alternating in the same invocation; steps/s from the train phase's
  duration (median over ranks, then over repetitions). Goal: on/off >= 0.99. Plus the cost of the
  tracker's EventLog listener per event (the only watchdog work on the training thread).
- barrier: `store_barrier` latency against one TCPStore: 2, 4 and 8 processes, then 16, 64 and 256 client
  threads in one process (GIL-bound, to show how the store's cost grows with the number of clients).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed.runs import SYNTHETIC, lifecycle_run  # noqa: E402

WHERE = {"init": "", "warmup": ", op: all_reduce, group: tp", "train": ", step: 3",
         "checkpoint": ", step: 4, op: save", "teardown": ", op: barrier"}
D = 3.0


def _latency_run(phase: str, poll: float) -> dict[int, float]:
    init = 8.0 if phase == "init" else 60.0
    over = [*SYNTHETIC, "parallelism.tp=2", "train.steps=4", "checkpoint.every_steps=2",
            f"watchdog.deadlines.init={init}", *(f"watchdog.deadlines.{p}={D}" for p in
                                                  ("warmup", "step", "checkpoint", "teardown")),
            "teardown.deadline_s=5", f"watchdog.poll_interval_s={poll}",
            f"+faults=[{{at: {phase}, ranks: [1], action: stall{WHERE[phase]}}}]"]
    with tempfile.TemporaryDirectory() as tmp:
        run = lifecycle_run(Path(tmp), 4, *over, timeout=120)
        events = run.events()
    deadline = init if phase == "init" else D
    reported = {r: next(e["t"] for e in evs if e["name"] == "hang_report") / 1e6
                for r, evs in sorted(events.items()) if any(e["name"] == "hang_report" for e in evs)}
    # The first deadline to pass anywhere: a rank's last begin/end before its report, plus the deadline.
    passed = min(max(e["t"] for e in events[r] if e["kind"] in ("begin", "end") and e["t"] / 1e6 <= t) / 1e6
                 for r, t in reported.items()) + deadline
    return {r: t - passed for r, t in reported.items()}


def latency() -> None:
    print("\n## detection latency: deadline passed -> report, per rank (s)")
    print(f"{'poll':>5} {'phase':<11} {'deadline':>8}  per rank (0..3)                  max")
    for poll in (1.0, 0.25):
        for phase in WHERE:
            lat = _latency_run(phase, poll)
            cells = " ".join(f"{lat.get(r, float('nan')):+.2f}" for r in range(4))
            print(f"{poll:>5} {phase:<11} {8.0 if phase == 'init' else D:>7g}s  {cells:<32} {max(lat.values()):+.2f}",
                  flush=True)


def _train_rate(watchdog: bool) -> float:
    over = [*SYNTHETIC, "parallelism.tp=1", "train.steps=2000", "checkpoint.every_steps=0", "checkpoint.at_end=false",
            "warmup.enabled=false", f"watchdog.enabled={str(watchdog).lower()}", "watchdog.sequence_check=false"]
    with tempfile.TemporaryDirectory() as tmp:
        run = lifecycle_run(Path(tmp), 2, *over, timeout=300)
        assert run.code == 0, run.output
        return 2000 / float(run.summary()["phases"]["train"]["median_s"])


def _listener_cost() -> tuple[float, float]:
    from lifecycle.obs.events import EventLog
    from lifecycle.watchdog.tracker import ProgressTracker

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for listen in (False, True):
            log = EventLog(Path(tmp), int(listen))
            if listen:
                log.listeners.append(ProgressTracker(0).on_event)
            n = 50_000
            t0 = time.perf_counter()
            for i in range(n):
                log.emit("begin" if i % 2 == 0 else "end", "step", step=i)
            out.append((time.perf_counter() - t0) / n * 1e6)
            log.close()
    return out[0], out[1]


def throughput(reps: int) -> None:
    print("\n## train-loop throughput, watchdog on vs off (synthetic, world 2, 2000 steps)")
    rates: dict[bool, list[float]] = {False: [], True: []}
    for i in range(reps):
        for on in (False, True) if i % 2 == 0 else (True, False):
            rates[on].append(_train_rate(on))
            print(f"  rep {i} watchdog={'on ' if on else 'off'} {rates[on][-1]:8.1f} steps/s", flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"median steps/s: off {off:.1f}, on {on:.1f}; ratio on/off {on / off:.3f}")
    bare, listened = _listener_cost()
    print(f"EventLog.emit: {bare:.2f} us/event bare, {listened:.2f} us/event with the tracker listener "
          f"(+{listened - bare:.2f} us; a train step emits 2 events)")


def _barrier_proc(rank: int, n: int, port: int, k: int, out: Any) -> None:
    from torch.distributed import TCPStore

    from lifecycle.distributed.barrier import store_barrier

    store = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
    ranks = list(range(n))
    store_barrier(store, f"warm/{n}", rank, ranks, 60)
    times = []
    for i in range(k):
        t0 = time.perf_counter()
        store_barrier(store, f"b{n}/{i}", rank, ranks, 60)
        times.append(time.perf_counter() - t0)
    out.put((rank, times))


def _barrier_case(n: int, k: int, threads: bool) -> list[float]:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    results: list[tuple[int, list[float]]] = []
    if threads:
        import queue

        q: Any = queue.Queue()
        workers = [threading.Thread(target=_barrier_proc, args=(r, n, server.port, k, q)) for r in range(n)]
    else:
        q = mp.get_context("spawn").Queue()
        workers = [mp.get_context("spawn").Process(target=_barrier_proc, args=(r, n, server.port, k, q))
                   for r in range(n)]
    for w in workers:
        w.start()
    for _ in range(n):
        results.append(q.get(timeout=300))
    for w in workers:
        w.join(30)
    del server
    per_barrier = [max(times[i] for _, times in results) for i in range(k)]  # the slowest rank of each barrier
    return per_barrier


def barrier() -> None:
    print("\n## store_barrier latency vs participants (one TCPStore; slowest participant per barrier)")
    print(f"{'participants':>14} {'kind':<8} {'median ms':>10} {'p90 ms':>8}")
    for n, threads, k in ((2, False, 300), (4, False, 300), (8, False, 200), (16, True, 100), (64, True, 50),
                          (256, True, 20)):
        lat = sorted(_barrier_case(n, k, threads))
        print(f"{n:>14} {'threads' if threads else 'procs':<8} {statistics.median(lat) * 1e3:>10.2f} "
              f"{lat[int(0.9 * (len(lat) - 1))] * 1e3:>8.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", default="latency,throughput,barrier")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import os
    import platform

    print(f"machine: {platform.platform()}, {os.cpu_count()} cpus, python {platform.python_version()}; "
          f"load {os.getloadavg()[0]:.1f}")
    for what in args.what.split(","):
        {"latency": latency, "throughput": lambda: throughput(args.reps), "barrier": barrier}[what]()


if __name__ == "__main__":
    main()
