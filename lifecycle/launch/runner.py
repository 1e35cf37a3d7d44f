"""`lifecycle run`: compose the policy once, then either launch local ranks or run as one rank.

With RANK/WORLD_SIZE in the environment (torchrun, srun wrappers) this process is one rank of a larger
job: it composes the same policy (the run id comes from TORCHELASTIC_RUN_ID / SLURM_JOB_ID, identical
on every rank) and runs the orchestrator in-process. Otherwise it writes the resolved policy into the
run directory, starts ``--nproc`` ranks through :func:`lifecycle.launch.launch_local`, and prints the
summary. It returns the exit code of the first rank that failed (``teardown.exit_codes.rank_failed`` when
that rank was killed by a signal).

Running the same command again with the same ``run.dir`` (or ``run.id``) continues the run as its next
attempt: the earlier attempt's files move to ``attempts/<N>/`` and the ranks resume from the last committed
checkpoint (``checkpoint.resume: auto`` or ``required``; ``never`` refuses a run directory that holds a run).
Before any rank starts, the run and checkpoint folders must be writable and what the checkpoint folder alone
decides (``resume: required`` without a checkpoint, a broken tracker) is checked: all exit 2.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import lifecycle.rundir as rundir
from lifecycle.errors import RunDirError, UsageError
from lifecycle.jsontypes import JsonDict
from lifecycle.machine.rankdir import own_run_dir, preflight, prepare_rank_dir, release_run_dir

if TYPE_CHECKING:
    from lifecycle.launch.local import PreloadPool
    from lifecycle.launch.signals import SignalTrap
    from lifecycle.policy.schema import Policy


def _new_run_id() -> str:
    # Generated once, here, and handed to every rank: never derived from per-rank clocks.
    return f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"


def run(overrides: Sequence[str], *, nproc: int = 4, config_dir: str | None = None,
        config_name: str = "config", oversubscribe: bool = False) -> int:
    """``lifecycle run``. Before any rank starts: the event sinks' packages (exit 2); as one rank of another
    launcher's job, its rendezvous (:mod:`lifecycle.launch.rendezvous`: rank 0's port, exit 2; a rank 0 that never
    comes, exit 3); as the local launcher, ``nproc`` against what this machine runs (:mod:`lifecycle.launch.capacity`,
    exit 2 unless ``oversubscribe``)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return _run_local(overrides, nproc=nproc, config_dir=config_dir, config_name=config_name,
                          oversubscribe=oversubscribe)
    from lifecycle.launch import rendezvous
    from lifecycle.launch.parent import die_with_launcher
    from lifecycle.machine.preflight import check_rendezvous_env, rank_env
    from lifecycle.obs import sinks
    from lifecycle.policy.load import load

    die_with_launcher()
    rank = rank_env()[0]
    check_rendezvous_env()
    policy = load(overrides, config_dir=config_dir, config_name=config_name).policy
    sinks.check(sinks.from_env())
    rendezvous.check(rank, policy.deadline("init"))
    return _run_as_rank(policy, overrides)


def _run_local(overrides: Sequence[str], *, nproc: int, config_dir: str | None, config_name: str,
               oversubscribe: bool) -> int:
    """``lifecycle run`` as the local launcher: the ranks' preload process starts first (its imports are the
    launch's longest part), then the policy is composed and checked."""
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1 (got {nproc})")
    started_at = time.time()
    os.environ.setdefault("LIFECYCLE_RUN_ID", _new_run_id())
    from lifecycle.launch.local import PreloadPool

    pool = PreloadPool()
    try:
        _prestart(pool)
        from lifecycle.launch import capacity
        from lifecycle.obs import sinks
        from lifecycle.policy.load import load

        loaded = load(overrides, config_dir=config_dir, config_name=config_name)
        sinks.check(sinks.from_env())
        capacity.check_nproc(loaded.policy, nproc, oversubscribe=oversubscribe)
        return launch(loaded.policy, nproc, overrides=overrides, pool=pool, started_at=started_at)
    finally:
        pool.close(kill=True)  # after a launch it is closed already; before one (a bad policy, exit 2) at once


def _prestart(pool: PreloadPool) -> None:
    """The ranks' preload process starts importing torch while the launcher composes the policy (about a second of
    every launch); megatron-core's modules follow when the policy needs them. Not where ranks start by ``exec``: a
    machine with an NVIDIA driver (see :func:`_preload`)."""
    from lifecycle.distributed.comm_memory import has_nvidia_driver
    from lifecycle.launch import preload

    if not has_nvidia_driver():
        pool.prestart(Path.cwd(), preload.TORCH)


def launch(policy: Policy, nproc: int, *, overrides: Sequence[str] = (), pool: PreloadPool | None = None,
           started_at: float | None = None) -> int:
    """Take the run directory, write the resolved policy, start the ranks, print and write the summary. ``pool``: a
    preload process already started; ``started_at``: when `lifecycle run` began (the first attempt's start-up counts
    from it)."""
    from lifecycle.launch.local import PreloadPool
    from lifecycle.launch.signals import SignalTrap

    run_dir = own_run_dir(policy)
    try:
        # Between attempts too, SIGINT/SIGTERM are a stop request: no next attempt starts (the launcher's own trap
        # takes over while ranks run).
        with SignalTrap(tuple(policy.checkpoint.signals)) as trap:
            return _launch(policy, nproc, run_dir, overrides, trap, pool or PreloadPool(), started_at)
    finally:
        release_run_dir(run_dir)


def _launch(policy: Policy, nproc: int, run_dir: Path, overrides: Sequence[str], trap: SignalTrap,
            pool: PreloadPool, started_at: float | None = None) -> int:
    """Attempts in ``run_dir`` until one succeeds, ``restart.max_restarts`` are spent, a failure that a restart
    cannot fix (a usage error, a stop the launcher was asked for) or ``restart.max_no_progress`` attempts in a row
    without a newer checkpoint (``exit_codes.no_progress``). Each restart is the next attempt: it resumes from the
    last committed checkpoint."""

    if rundir.holds_run(run_dir) and policy.checkpoint.resume == "never":
        raise UsageError(f"run directory {run_dir} already holds a run and checkpoint.resume=never; pick another "
                         f"run.name/run.id, remove it, or set checkpoint.resume=auto to continue it")
    preflight(policy, nproc, ranks_per_node=nproc)
    code: int | None = None
    try:  # one preload process for every attempt: a relaunch does not import torch again
        code = _attempts(policy, nproc, run_dir, overrides, trap, pool, started_at)
        return code
    finally:
        pool.close()
        _memory_copies_after(policy, code)


def _memory_copies_after(policy: Policy, code: int | None) -> None:
    """The run is over on this node: the memory tier's copies (node memory) stay for the run's next attempt after a
    failure, said with the way to free them; otherwise they go (:func:`lifecycle.recovery.decisions.keep_copies`)."""
    m = policy.checkpoint.memory
    if not m.every_steps:
        return
    from lifecycle.recovery import copies as memory
    from lifecycle.recovery.decisions import keep_copies

    base = memory.root(m.dir, policy.checkpoint.dir)
    if not keep_copies(policy, code) or not base.is_dir():
        memory.remove(base)
        return
    print(f"memory   copies kept in {base} for the next attempt of this run (rm -rf {base} frees them)", flush=True)


def _attempts(policy: Policy, nproc: int, run_dir: Path, overrides: Sequence[str], trap: SignalTrap,
              pool: PreloadPool, started_at: float | None = None) -> int:
    """The attempts; the last one's trace and picture once no other follows (a restarted attempt's would delay the
    next one by a second or more: `lifecycle timeline` draws them from attempts/<N>/ at any time). A launcher stopped by
    a signal (a preemption, a scheduler's requeue) neither draws nor reads every attempt for the run's goodput: it
    leaves within the stop's grace, and says how to get both."""
    from lifecycle.recovery import decisions

    budget = decisions.Budget.of(policy)
    failed: int | None = None  # the exit code of the attempt that failed before this one
    info: JsonDict = {}  # its summary
    while True:
        if trap.received and failed is not None:  # a stop between attempts: no next one; the failure stands
            print(f"lifecycle: {trap.received[0].name}: not starting another attempt (the last one failed, exit "
                  f"{failed})", file=sys.stderr, flush=True)
            return _stopped(policy, run_dir, failed)
        refused = _refusal(policy, run_dir)
        if refused is not None:
            print(f"lifecycle: {refused}", file=sys.stderr, flush=True)
            code = policy.teardown.exit_codes.no_progress
            return code if failed is None else _final(policy, run_dir, info, trap, code, printed=True)
        code, info, stopped, started = _attempt(policy, nproc, run_dir, overrides, budget.left, pool,
                                                started_at if failed is None else None)
        budget.spend_in_place(started, int(info.get("attempt") or started))
        attempt = info.get("attempt") or started
        ends = budget.spent or stopped or decisions.final(code, policy)
        stop = stopped or bool(trap.received)
        if ends and not stop:
            return _final(policy, run_dir, info, trap, code)
        _summarize(run_dir, info, goodput=False)
        if trap.received and not ends:
            print(f"lifecycle: {trap.received[0].name} after attempt {attempt} failed (exit {code}): not "
                  f"restarting", file=sys.stderr, flush=True)
        if stop:
            return _stopped(policy, run_dir, code)
        failed = code
        print(decisions.restart_line(policy, info, code, budget.spend_relaunch()), flush=True)
        if policy.run.timeline != "off":
            print(f"timeline attempt {attempt}: drawn later with `lifecycle timeline "
                  f"{run_dir / rundir.ATTEMPTS_DIR / str(attempt)}`", flush=True)


def _refusal(policy: Policy, run_dir: Path) -> str | None:
    """The launcher's no-progress verdict before it starts the next attempt (rank 0 gives the same at init)."""
    from lifecycle.policy.load import sha256
    from lifecycle.recovery import progress

    return progress.verdict(run_dir, policy, sha256(policy))[0]


def _attempt(policy: Policy, nproc: int, run_dir: Path, overrides: Sequence[str],
             restarts_left: int, pool: PreloadPool, started_at: float | None = None) -> tuple[int, JsonDict, bool, int]:
    """One attempt (and the attempts its ranks restarted in place): its files, its ranks, its summary. (exit code,
    summary, whether the launcher was stopped, the attempt it started as)."""
    from lifecycle.launch.local import launch_local
    from lifecycle.machine import preflight as checks
    from lifecycle.machine.session import ENV_RESTARTS_LEFT
    from lifecycle.obs import summary
    from lifecycle.policy.load import write_resolved
    from lifecycle.rundir import restarts, safeio

    attempt = rundir.archive_attempt(run_dir)
    checks.mark_owner(run_dir)
    write_resolved(policy, run_dir)
    safeio.write_text(run_dir / rundir.OVERRIDES, "".join(f"{o}\n" for o in overrides))
    again = f"attempt {attempt}, " if attempt > 1 else ""
    print(f"lifecycle: {again}{nproc} ranks, run directory {run_dir}", flush=True)
    result = launch_local([sys.executable, "-m", "lifecycle.launch.worker", str(run_dir)], nproc, run_dir,
                          env={rundir.ENV_ATTEMPT: str(attempt), ENV_RESTARTS_LEFT: str(restarts_left)},
                          preempt_grace_s=policy.checkpoint.grace_s + policy.teardown.deadline_s,
                          preload=_preload(policy), pool=pool, launched_at=started_at)
    if result.first_failure is not None and result.per_rank.get(result.first_failure, 0) < 0:
        # A rank killed by a signal (kill -9, the OOM killer) died: the policy's code for that, not 128+N (the
        # signal stays in the outcome line and the summary).
        result = dataclasses.replace(result, exit_code=policy.teardown.exit_codes.rank_failed)
    info = summary.build(run_dir, result, goodput=False)
    if result.exit_code:
        _exclude(run_dir, info)
    # The last attempt, in place too; never an earlier one (ranks killed before they wrote an event name none).
    restarts.record_end(run_dir, max(int(info.get("attempt") or 0), attempt), int(result.exit_code))
    return int(result.exit_code), info, result.stopped_by is not None, attempt


def _final(policy: Policy, run_dir: Path, info: JsonDict, trap: SignalTrap, code: int, *,
           printed: bool = False) -> int:
    """No attempt follows this one: the run's goodput over every attempt into its summary, written and printed
    (only its line where the summary was ``printed`` already: the no-progress verdict between attempts), while a
    child process draws the trace and picture (``run.timeline``) from the same files; ``code`` back once both are
    done."""
    from lifecycle.obs import summary
    from lifecycle.obs.timeline import start_end_of_job

    _write(run_dir, info)  # the verdict the picture's title reads
    drawing = start_end_of_job(run_dir, policy.run.timeline)
    if printed:
        summary.add_goodput(run_dir, info)
        _write(run_dir, info)
        line = (info.get("goodput") or {}).get("line")
        if line:
            print(f"goodput  {line}", flush=True)
    else:
        _summarize(run_dir, info, goodput=True)
    if drawing is not None:
        drawing.finish(lambda: bool(trap.received))
    return code


def _summarize(run_dir: Path, info: JsonDict, *, goodput: bool) -> None:
    """Write and print an attempt's summary; ``goodput``: with the run's goodput (the last attempt: it reads every
    attempt's events, which a relaunch does not wait for)."""
    from lifecycle.obs import summary

    if goodput:
        summary.add_goodput(run_dir, info)
    _write(run_dir, info)
    print(summary.render(info), flush=True)


def _write(run_dir: Path, info: JsonDict) -> None:
    """``summary.json``; a full disk is said, and the verdict is still printed and its code returned."""
    from lifecycle.obs import summary

    try:
        summary.write(run_dir, info)
    except (OSError, RunDirError) as exc:
        print(f"lifecycle: cannot write {run_dir / rundir.SUMMARY} ({getattr(exc, 'strerror', None) or exc})",
              file=sys.stderr, flush=True)


def _stopped(policy: Policy, run_dir: Path, code: int) -> int:
    """The launcher was stopped (a preemption): no goodput over every attempt, no picture, both named; ``code``
    back."""
    print(f"goodput  `lifecycle goodput {run_dir}` (not read on a stop: the launcher leaves within its grace)",
          flush=True)
    if policy.run.timeline != "off":
        print(f"timeline drawn later with `lifecycle timeline {run_dir}`", flush=True)
    return code


def _preload(policy: Policy) -> tuple[str, ...] | None:
    """What the ranks import before they fork from one process (megatron-core when the train kind's groups are
    Megatron's), see :mod:`lifecycle.launch.preload`; None (each rank starts by exec) on a machine with an NVIDIA
    driver: an import may touch CUDA there, and a CUDA context does not survive a fork."""
    from lifecycle.distributed.comm_memory import backend_of, has_nvidia_driver
    from lifecycle.launch import preload
    from lifecycle.policy import registry

    if backend_of(policy) != "gloo" or has_nvidia_driver():
        return None
    return preload.modules_for(registry.get("train", policy.train.kind).groups != "torch")


def _exclude(run_dir: Path, info: JsonDict) -> None:
    """The hosts the attempt's verdict blames, into the run's exclusion list (a report must not fail the run)."""
    from lifecycle.recovery import exclusions

    try:
        exclusions.record(run_dir, info)
    except (OSError, RunDirError) as exc:
        print(f"lifecycle: exclusion list not written ({exc})", file=sys.stderr, flush=True)


def _run_as_rank(policy: Policy, overrides: Sequence[str]) -> int:
    from lifecycle.machine.preflight import rank_env
    from lifecycle.machine.session import run_rank

    rank, world, _ = rank_env()
    run_dir = prepare_rank_dir(policy, rank, world, overrides, hint="torchrun --rdzv-id")
    code = run_rank(run_dir, policy)
    # Leave now, as the local launcher's ranks do: interpreter shutdown could wait on threads or process
    # groups that a dead peer left blocked (a gloo group joins its worker threads when destroyed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
