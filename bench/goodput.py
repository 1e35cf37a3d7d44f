"""Goodput under failures, side by side: the default megatron job at world 4 through the same seeded schedule of
failures, injected from outside the processes, for three contenders:

  (a) lifecycle with the memory tier     `lifecycle run`, checkpoint.memory.every_steps=M, commits every K steps
  (b) lifecycle, persistent tier only    the same without the memory tier
  (c) the usual Megatron setup           bench/plain_megatron.py under `torchrun --max-restarts`, a synchronous
                                         dist_checkpointing save every K steps, resume from the latest, Megatron's
                                         default distributed_timeout_minutes (10)

plus (a) without failures (its losses are the ones every lifecycle contender must reach). Both lifecycle contenders
use learned step deadlines (`watchdog.deadlines.step=auto`) and `restart.max_restarts`; every contender resumes after
a preemption by being launched again (a scheduler's requeue).

    .venv/bin/python bench/goodput.py [--steps 3000] [--every 500] [--seed 43] [--memory-every 5] [--commit-every 50]
                                      [--only clean,a,b,c] [--mode relaunch|in_process] [--kinds ...]
                                      [--out bench/goodput.json]

The schedule: one failure about every ``--every`` steps (jittered), kinds drawn in seeded rounds of kill (kill -9 of a
rank), stall (SIGSTOP of a rank: frozen), raise (an exception on a rank: lifecycle's raise drill, the plain script's
own raise at the same step and attempt) and preempt (SIGTERM to the launcher, then launched again), ranks at random.
A failure fires when the contender's rank 0 finishes the step named in the schedule.

Per contender: the wall time to reach ``--steps``; goodput = productive step time / wall time (lifecycle: `lifecycle
goodput`'s buckets; plain: from its per-step records, the same rule — a step computed again later is lost); the
cost of each failure = from the moment it fired until the run is past the same step again (detection, restart,
restore and the steps computed again); the final loss.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("kill", "stall", "raise", "preempt")
LIMIT_S = float(os.environ.get("BENCH_LIMIT_S", "3600"))


@dataclass
class Failure:
    kind: str
    step: int
    rank: int
    attempt: int = 0
    """The attempt it fires in (1-based; every failure before it started one more)."""
    fired_s: float | None = None
    regained_s: float | None = None

    @property
    def cost_s(self) -> float | None:
        return None if self.fired_s is None or self.regained_s is None else self.regained_s - self.fired_s


def schedule(seed: int, steps: int, every: int, kinds_: tuple[str, ...] = KINDS) -> list[Failure]:
    rng = random.Random(seed)
    kinds: list[str] = []
    out = []
    n = max(int(steps / every - 0.5), 1)
    for i in range(n):
        if not kinds:
            kinds = list(kinds_)
            rng.shuffle(kinds)
        at = every * (i + 1) - every // 2 + rng.randint(-every // 5, every // 5)
        out.append(Failure(kinds.pop(), at, rng.randrange(4), attempt=i + 1))
    return out


class Progress:
    """(attempt, step, loss) records of rank 0, read as they are written."""

    def __init__(self, path: Path, lifecycle: bool) -> None:
        self.path, self.lifecycle = path, lifecycle
        self.offset, self.inode = 0, None
        self.attempt = 0
        self.last: tuple[int, int, float | None] | None = None

    def read(self) -> list[tuple[int, int, float | None]]:
        try:
            st = self.path.stat()
        except OSError:
            return []
        if st.st_ino != self.inode or st.st_size < self.offset:  # a relaunch archived the attempt's files
            self.inode, self.offset = st.st_ino, 0
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self.offset += cut
        out = []
        for line in data[:cut].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if self.lifecycle:
                if e.get("name") == "attempt" and isinstance(e.get("attempt"), int):
                    self.attempt = e["attempt"]
                if e.get("name") == "step" and e.get("kind") == "end" and isinstance(e.get("step"), int):
                    out.append((self.attempt, e["step"], e.get("loss")))
            else:
                out.append((e["a"], e["step"], e.get("loss")))
        if out:
            self.last = out[-1]
        return out


@dataclass
class Result:
    name: str
    wall_s: float = 0.0
    finished: bool = False
    launches: int = 0
    goodput: float | None = None
    buckets_s: dict[str, float] = field(default_factory=dict)
    steps_lost: int | None = None
    final_loss: float | None = None
    losses: dict[int, float] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)


MODE = "relaunch"
"""restart.mode of the lifecycle contenders (--mode)."""
EXTRA: list[str] = []
"""More overrides for the lifecycle contenders (--set)."""


def _lifecycle_cmd(run_dir: Path, steps: int, commit: int, memory: int, shm: Path, raises: list[Failure]) -> list[str]:
    drills = ", ".join(f"{{at: train, step: {f.step}, ranks: [{f.rank}], action: raise, attempts: [{f.attempt}]}}"
                       for f in raises)
    cmd = [sys.executable, "-m", "lifecycle", "run", "--nproc", "4", f"run.dir={run_dir}", f"train.steps={steps}",
           f"checkpoint.every_steps={commit}", "restart.max_restarts=50", "restart.max_no_progress=0",
           "watchdog.deadlines.step=auto", "run.timeline=trace", f"restart.mode={MODE}"]
    if memory:
        cmd += [f"checkpoint.memory.every_steps={memory}", f"checkpoint.memory.dir={shm}"]
    if drills:
        cmd.append(f"+faults=[{drills}]")
    return cmd + EXTRA


def _plain_cmd(folder: Path, steps: int, commit: int, raises: list[Failure]) -> list[str]:
    spec = ",".join(f"{f.attempt}:{f.step}:{f.rank}" for f in raises)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "50", "--monitor-interval", "0.5", str(ROOT / "bench" / "plain_megatron.py"),
            "--steps", str(steps), "--save-every", str(commit), "--ckpt", str(folder / "ckpt"),
            "--progress", str(folder / "progress.jsonl"), "--raise", spec]


def _rank_pids(folder: Path, lifecycle: bool) -> dict[int, int]:
    out = {}
    for rank in range(4):
        if lifecycle:
            path = folder / "run" / "events" / f"rank_{rank}.jsonl"
            try:
                pids = [json.loads(line).get("pid") for line in path.read_text().splitlines() if '"attempt"' in line]
            except (OSError, ValueError):
                continue
            pids = [p for p in pids if isinstance(p, int)]
            if pids:
                out[rank] = pids[-1]
        else:
            try:
                out[rank] = int((folder / f"progress.jsonl.pid.{rank}").read_text())
            except (OSError, ValueError):
                continue
    return out


def contend(name: str, folder: Path, steps: int, commit: int, memory: int, plan: list[Failure],
            lifecycle: bool) -> Result:
    """Run one contender through ``plan`` until it reaches ``steps``."""
    folder.mkdir(parents=True)
    shm = folder / "shm"
    shm.mkdir()
    raises = [f for f in plan if f.kind == "raise"]
    progress = Progress(folder / "run" / "events" / "rank_0.jsonl" if lifecycle else folder / "progress.jsonl",
                        lifecycle)
    pending = [Failure(**{**asdict(f)}) for f in plan]
    fired: list[Failure] = []
    stopped: list[int] = []
    res = Result(name)
    t0 = time.monotonic()
    log = open(folder / "output.log", "w")  # noqa: SIM115 - closed below
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIFECYCLE_EVENTS_FLUSH_EVERY": "1"}  # rank 0's steps, live
    done = 0
    while time.monotonic() - t0 < LIMIT_S:
        base = res.launches
        cmd = (_lifecycle_cmd(folder / "run", steps, commit, memory, shm, raises) if lifecycle
               else _plain_cmd(folder, steps, commit, raises))
        res.launches += 1
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**env, "BENCH_ATTEMPT_BASE": str(_attempts_before(progress, base))})
        while proc.poll() is None and time.monotonic() - t0 < LIMIT_S:
            for attempt, step, loss in progress.read():
                now = time.monotonic() - t0
                done = max(done, step)
                if loss is not None:
                    res.losses[step] = loss
                for f in fired:  # past the step it fired at again, in a later attempt
                    if f.regained_s is None and step >= f.step - 1 and attempt > f.attempt:
                        f.regained_s = now
                # A failure "at step S" comes as step S begins: once S - 1 is done (a raise drill's own moment)
                if pending and step >= pending[0].step - 1 and attempt >= pending[0].attempt:
                    f = pending.pop(0)
                    f.fired_s, f.attempt = now, attempt
                    fired.append(f)
                    _fire(f, proc, folder, lifecycle, stopped)
            time.sleep(0.02)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in stopped:  # a frozen rank its launcher did not take down
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _attempt, step, loss in progress.read():
            done = max(done, step)
            if loss is not None:
                res.losses[step] = loss
        if proc.returncode == 0 and done >= steps:
            res.finished = True
            break
        print(f"  {name}: launch {res.launches} ended (exit {proc.returncode}) at step {done}: launching again",
              flush=True)
    res.wall_s = time.monotonic() - t0
    log.close()
    res.failures = [asdict(f) | {"cost_s": f.cost_s} for f in fired + pending]
    res.final_loss = res.losses.get(steps)
    if lifecycle:
        out = subprocess.run([sys.executable, "-m", "lifecycle", "goodput", str(folder / "run"), "--json"],
                             capture_output=True, text=True, cwd=ROOT)
        g = json.loads(out.stdout)
        res.buckets_s = {k: round(v, 2) for k, v in g["buckets_s"].items()}
        res.steps_lost = g["steps"]["lost"]
        res.goodput = g["buckets_s"]["productive"] / res.wall_s
    else:
        res.buckets_s, res.steps_lost = _plain_accounting(folder / "progress.jsonl", res.wall_s)
        res.goodput = res.buckets_s["productive"] / res.wall_s
    return res


def _attempts_before(progress: Progress, launches: int) -> int:
    """The plain script's attempts before this launch: the last attempt it recorded (0 at the first launch)."""
    return progress.last[0] if progress.last is not None and launches else 0


def _fire(f: Failure, proc: subprocess.Popen[bytes], folder: Path, lifecycle: bool, stopped: list[int]) -> None:
    if f.kind == "raise":
        return  # the contender raises by itself at this step and attempt (its drill / --raise)
    if f.kind == "preempt":
        os.kill(proc.pid, signal.SIGTERM)  # the launcher: lifecycle run, or torchrun
        return
    pid = _rank_pids(folder, lifecycle).get(f.rank)
    if pid is None:
        print(f"  no pid for rank {f.rank}: {f.kind} not fired", flush=True)
        return
    if f.kind == "kill":
        os.kill(pid, signal.SIGKILL)
    elif f.kind == "stall":
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)


def _plain_accounting(path: Path, wall_s: float) -> tuple[dict[str, float], int]:
    """productive / lost step time of the plain contender's records (a step computed again later is lost), the
    rest of the wall time as ``other``."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    survivors: dict[int, float] = {}
    lost_s, lost = 0.0, 0
    for r in records:
        for later in [s for s in survivors if s >= r["step"]]:
            lost_s += survivors.pop(later)
            lost += 1
        survivors[r["step"]] = r["t1"] - r["t0"]
    productive = sum(survivors.values())
    return {"productive": round(productive, 2), "lost": round(lost_s, 2),
            "other": round(wall_s - productive - lost_s, 2)}, lost


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=500)
    p.add_argument("--seed", type=int, default=43)
    p.add_argument("--memory-every", type=int, default=5)
    p.add_argument("--commit-every", type=int, default=50)
    p.add_argument("--only", default="clean,a,b,c")
    p.add_argument("--kinds", default=",".join(KINDS), help="the failure kinds drawn (default: all four)")
    p.add_argument("--out", default=str(ROOT / "bench" / "goodput.json"))
    p.add_argument("--keep", default=None, help="keep the contenders' run directories under this folder")
    p.add_argument("--set", action="append", default=[], metavar="OVERRIDE",
                   help="a policy override for the lifecycle contenders (repeatable)")
    p.add_argument("--mode", default="relaunch", choices=["relaunch", "in_process"],
                   help="restart.mode of the lifecycle contenders")
    a = p.parse_args()
    global MODE  # noqa: PLW0603 - one setting for every contender of this invocation
    MODE = a.mode
    EXTRA[:] = a.set
    plan = schedule(a.seed, a.steps, a.every, tuple(a.kinds.split(",")))
    print("schedule: " + ", ".join(f"{f.kind}@{f.step}/r{f.rank}" for f in plan), flush=True)
    contenders = {"clean": ("lifecycle, memory tier, no failures", a.memory_every, [], True),
                  "a": ("lifecycle, memory tier", a.memory_every, plan, True),
                  "b": ("lifecycle, persistent tier only", 0, plan, True),
                  "c": ("torchrun + dist_checkpointing (no lifecycle)", 0, plan, False)}
    results: dict[str, Result] = {}
    with tempfile.TemporaryDirectory(prefix="bench-goodput-") as scratch:
        tmp = a.keep or scratch
        for key in a.only.split(","):
            label, memory, failures, lifecycle = contenders[key]
            print(f"({key}) {label} ...", flush=True)
            r = contend(label, Path(tmp) / key, a.steps, a.commit_every, memory, failures, lifecycle)
            results[key] = r
            print(f"({key}) wall {r.wall_s:.1f}s goodput {r.goodput:.3f} lost steps {r.steps_lost} final loss "
                  f"{r.final_loss} buckets {r.buckets_s}", flush=True)
            for f in r.failures:
                print(f"      {f['kind']:8} step {f['step']:5} rank {f['rank']}: "
                      + (f"cost {f['cost_s']:.1f}s" if f["cost_s"] is not None else "not recovered/fired"), flush=True)
    _report(results, a)
    Path(a.out).write_text(json.dumps({"args": vars(a), "results": {k: asdict(v) | {"losses": None}
                                                                     for k, v in results.items()}}, indent=1))


def _report(results: dict[str, Result], a: argparse.Namespace) -> None:
    print(f"\nsteps {a.steps}, a failure about every {a.every} steps (seed {a.seed}), commits every {a.commit_every}, "
          f"memory copies every {a.memory_every}")
    print("| contender | wall s | goodput | steps lost | final loss | " + " | ".join(f"{k} cost s" for k in KINDS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(KINDS))
    for key, r in results.items():
        costs = []
        for kind in KINDS:
            c = [f["cost_s"] for f in r.failures if f["kind"] == kind and f["cost_s"] is not None]
            costs.append(f"{sum(c) / len(c):.1f}" if c else "—")
        loss = f"{r.final_loss:.6f}" if r.final_loss is not None else "—"
        print(f"| ({key}) {r.name} | {r.wall_s:.1f} | {r.goodput:.3f} | {r.steps_lost} | {loss} | "
              + " | ".join(costs) + " |")
    clean = results.get("clean")
    for key in ("a", "b"):
        if clean and key in results and results[key].final_loss is not None:
            same = results[key].final_loss == clean.final_loss
            print(f"({key}) final loss {'==' if same else '!='} the uninterrupted run's")
    if "a" in results and "c" in results:
        print(f"goodput (a)/(c) = {results['a'].goodput / results['c'].goodput:.2f}, "
              f"(b)/(c) = {results['b'].goodput / results['c'].goodput:.2f}" if "b" in results else "")


if __name__ == "__main__":
    main()
