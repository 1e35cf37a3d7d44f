"""One rank's session: the one place that assembles a rank's run, for ``lifecycle run`` / torchrun / srun ranks
(:func:`run_rank`, entered by ``python -m lifecycle.launch.worker RUN_DIR``) and for ``lifecycle.attach()``
(:mod:`lifecycle.machine.job`): the run context, the model-parallel groups' creator, the signal handlers, the
watchdog, the drills, and the next attempt of an in-process restart.

The ranks of ``lifecycle run`` read the resolved policy from the run directory (they never compose) and take rank and
world size from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK: torchrun, srun or ``lifecycle run``).
Where attach differs: the trainer owns its loop, model and process groups, so attach builds the same context and
watchdog here but steps through ``Job``, and restarts in place are the trainer's.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING

import lifecycle.rundir as rundir
from lifecycle.distributed.ranks import fmt_ranks
from lifecycle.machine.blocked_stop import BEFORE_TRAINING, WATCHER
from lifecycle.machine.preflight import rank_env
from lifecycle.rundir import RESOLVED, has_marker

if TYPE_CHECKING:
    from lifecycle.context import RunContext
    from lifecycle.distributed.faults import Drills
    from lifecycle.distributed.parallel import ParallelState
    from lifecycle.machine.orchestrator import Orchestrator
    from lifecycle.obs.events import EventLog
    from lifecycle.policy.schema import FaultDrill, Policy
    from lifecycle.recovery.inprocess import InProcessRestart

log = logging.getLogger(__name__)
ENV_RESTARTS_LEFT = "LIFECYCLE_RESTARTS_LEFT"
"""Set by the local launcher for its ranks: the restarts (``restart.max_restarts``) this job has left."""


def install_signals(ctx: RunContext, orchestrator: Orchestrator, *, own_loop: bool = False) -> Callable[[], None]:
    """Preemption signals set a flag handled at the next step boundary; the launcher's shutdown SIGTERM
    (the run directory has a ``.shutdown`` marker) leaves through the failure path instead.

    ``own_loop`` (a trainer's process, ``lifecycle.attach``): the handlers it had are called after lifecycle's (its
    own preemption logic still fires), and with ``checkpoint.on_signal: false`` lifecycle installs none at all.
    Returns what puts the handlers that were there back."""
    from lifecycle.errors import Shutdown

    chained: dict[int, Callable[[int, FrameType | None], object]] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        try:
            if has_marker(ctx.run_dir):
                # Raise only where the orchestrator turns it into the failure path: not before the run started,
                # not while a failure is already being handled (the watchdog acts on the marker there).
                if orchestrator.current not in (None, "teardown") and orchestrator.error is None:
                    orchestrator.shutdown = Shutdown(f"{name} from the launcher: another rank failed")
                    raise orchestrator.shutdown
                return
            if orchestrator.current == "teardown":
                log.info("%s during teardown: ignored", name)
                return
            if ctx.progress.stop.preempt_signal is None and orchestrator.current in BEFORE_TRAINING:
                log.warning("%s received before training: the ranks stop at the first step boundary (nothing to save "
                            "yet)", name)
            elif ctx.progress.stop.preempt_signal is None:
                log.warning("%s received: will save and stop at the next step boundary", name)
            ctx.progress.stop.preempt_signal = name
        finally:
            previous = chained.get(signum)
            if previous is not None:
                previous(signum, frame)

    saved: dict[int, object] = {}

    def restore() -> None:
        for sig, before in saved.items():
            if signal.getsignal(sig) is on_signal:  # a handler the trainer set since is its own
                signal.signal(sig, before)  # type: ignore[arg-type]

    if own_loop and not ctx.policy.checkpoint.on_signal:
        return restore
    names = set(ctx.policy.checkpoint.signals if ctx.policy.checkpoint.on_signal else []) | {"SIGTERM"}
    for name in names:
        sig = getattr(signal, name)
        before = signal.signal(sig, on_signal)
        saved[sig] = before
        if own_loop and callable(before) and before is not signal.default_int_handler:
            chained[sig] = before  # the trainer's: SIG_DFL/SIG_IGN and Python's KeyboardInterrupt are not chained
    if not own_loop:  # a rank stuck before training never reaches the flag's step (lifecycle.machine.blocked_stop)
        WATCHER.watch(ctx, orchestrator, set(saved))
    from lifecycle.machine.stops import take_early

    for sig in take_early({signal.Signals(s) for s in saved}):  # what came while the rank started (lifecycle.launch.signals.record_early)
        if sig in saved:
            on_signal(sig, None)
    return restore


def run_rank(run_dir: Path, policy: Policy | None = None) -> int:
    """Run this rank of the run in ``run_dir`` (policy read from there unless given); returns the exit code."""
    from lifecycle.machine.orchestrator import Orchestrator
    from lifecycle.policy.load import read_resolved

    if policy is None:
        policy = read_resolved(run_dir / RESOLVED)
    rank, world, local_rank = rank_env()
    ctx = build_context(policy, run_dir, rank, world, local_rank, parallel_for(policy))
    while True:
        orchestrator = Orchestrator(ctx)
        install_signals(ctx, orchestrator)
        start_watchdog(ctx)
        try:
            result = orchestrator.run()
        finally:
            if ctx.watchdog is not None:
                ctx.watchdog.stop()
        if isinstance(result, int):
            return result
        # The failed attempt's error and its frames hold its model and optimizer: they go before the next ones are
        # built (the signal handlers still hold the old orchestrator until the next ones are installed).
        orchestrator.error = None
        del orchestrator
        ctx = next_attempt(ctx, result)


def next_attempt(ctx: RunContext, restart: InProcessRestart) -> RunContext:
    """The context of the attempt after ``restart`` in this process (``restart.mode: in_process``): the same events
    file, drills re-armed for the new attempt, one restart fewer; its init re-creates the process groups on
    ``restart.base`` under a prefix of the new round. Rank 0 records the failed attempt's end and the new attempt."""
    import gc

    import torch

    from lifecycle.context import Communicators, Progress, RunContext
    from lifecycle.rundir import restarts

    gc.collect()  # the failed attempt's model and optimizer (held in cycles with its error) before the next ones
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    left = _left_alive(torch)
    if left["modules"]:
        log.warning("the failed attempt left %d module(s) alive (%d parameter bytes): the next model is built beside "
                    "them", left["modules"], left["param_bytes"])
    policy, attempt = ctx.policy, restart.attempt + 1
    restarts_left = ctx.progress.restarts_left - 1
    ctx.events.instant("restart_in_process", left_alive_modules=left["modules"],
                       left_alive_param_bytes=left["param_bytes"], rss_bytes=left["rss_bytes"] or None,
                       failed_attempt=restart.attempt, attempt=attempt,
                       exit_code=restart.exit_code, error=restart.error, cause=restart.cause,
                       culprits=restart.culprits, failed_phase=restart.phase, last_step=restart.step,
                       resumed_from=ctx.progress.resumed_from, failed_at=restart.failed_at, report_s=restart.report_s,
                       destroy_s=restart.destroy_s, agree_s=restart.agree_s, pid=os.getpid(), restarts_left=restarts_left)
    if ctx.rank == 0:
        if ctx.progress.started_attempt:
            restarts.record_end(ctx.run_dir, restart.attempt, restart.exit_code)
        rundir.record_attempt(ctx.run_dir, attempt)
        rundir.keep_report(ctx.run_dir, restart.attempt)
        who = (f"ranks {fmt_ranks(restart.culprits)} ({restart.cause} in phase {restart.phase})" if restart.culprits
               else f"{restart.error} in phase {restart.phase}")
        done = policy.restart.max_restarts - restarts_left
        print(f"restart  attempt {restart.attempt} failed (exit {restart.exit_code}): {who}; in-process restart "
              f"{done} of {policy.restart.max_restarts}: the same processes re-create their groups and resume from "
              f"the last committed checkpoint", flush=True)
    ctx.events.instant("attempt", attempt=attempt, world_size=ctx.world_size, in_process=True, pid=os.getpid())
    drills = _drills(policy, ctx.rank, ctx.events, attempt)
    drills.held = ctx.drills.held
    progress = Progress(restarts_left=restarts_left)
    progress.stop.preempt_signal = ctx.progress.stop.preempt_signal  # a preemption that arrived meanwhile still stops
    return RunContext(replace(ctx.identity, policy=policy, attempt=attempt), ctx.events, drills, ctx.parallel,
                      progress=progress,
                      comms=Communicators(restart_round=ctx.comms.restart_round + 1, restart_base=restart.base))


def _left_alive(torch: ModuleType) -> dict[str, int]:
    """What of a failed attempt is still alive after a full collection, before the next one is built: modules and
    the bytes of their parameters (a restart in place must not build its model beside the old one)."""
    import gc

    module_type = torch.nn.Module
    modules = [o for o in gc.get_objects() if issubclass(type(o), module_type)]
    seen: set[int] = set()
    size = 0
    for m in modules:
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                size += p.numel() * p.element_size()
    return {"modules": len(modules), "param_bytes": size, "rss_bytes": _rss_bytes()}


def _rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def start_up_s() -> float | None:
    """Seconds since this rank's start-up began (where goodput's start-up begins): since the local launcher began
    this launch when it says so (a rank forked from the preload process inherited imports made before it existed),
    else since this process started (its imports included); None when neither is known."""
    age = process_age_s()
    try:
        since = time.time() - float(os.environ.get(rundir.ENV_LAUNCHED, ""))
    except ValueError:
        return age
    return round(since, 3) if 0 <= since < 3600 and (age is None or since > age) else age


def process_age_s() -> float | None:
    """Seconds since this process started, or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            started = int(f.read().rsplit(b")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime", "rb") as f:
            return round(max(float(f.read().split()[0]) - started, 0.0), 3)
    except (OSError, ValueError, IndexError):
        return None


def build_context(policy: Policy, run_dir: Path, rank: int, world: int, local_rank: int,
                  parallel: ParallelState, *, own_loop: bool = False) -> RunContext:
    """This rank's context: its attempt, its event log (the ``attempt`` event first), the policy's drills."""
    from lifecycle.context import RunContext
    from lifecycle.machine.preflight import events_flush_every
    from lifecycle.obs.events import EventLog

    attempt = _attempt(run_dir, rank)
    events = EventLog(run_dir, rank, local_rank, flush_every=events_flush_every())
    events.instant("attempt", attempt=attempt, world_size=world, pid=os.getpid(), process_start_s=start_up_s())
    return RunContext.of(policy, run_dir, rank, world, local_rank, events, _drills(policy, rank, events, attempt),
                         parallel, attempt=attempt, own_loop=own_loop, restarts_left=_restarts_left(policy))


def _drills(policy: Policy, rank: int, events: EventLog, attempt: int) -> Drills:
    """The policy's drills of ``attempt`` on this rank, each firing recorded in its events."""
    from lifecycle.distributed.faults import Drills

    return Drills(policy.faults, rank, on_fire=lambda f: _drill_fired(events, f),
                  crash_code=policy.teardown.exit_codes.rank_failed, attempt=attempt)


def _restarts_left(policy: Policy) -> int:
    """The local launcher says how many restarts this job has left; otherwise the policy's (under torchrun and
    SLURM each new process starts with ``restart.max_restarts`` in-process restarts; theirs bound the relaunches)."""
    given = os.environ.get(ENV_RESTARTS_LEFT, "")
    return min(int(given), policy.restart.max_restarts) if given.isdigit() else policy.restart.max_restarts


def parallel_for(policy: Policy) -> ParallelState:
    """The model-parallel groups' creator the train kind asks for (its ``HandlerSpec.groups``)."""
    from lifecycle.policy import registry

    if registry.get("train", policy.train.kind).groups == "torch":
        from lifecycle.distributed.native import NativeParallel

        return NativeParallel()
    from lifecycle.backends.megatron.parallel import MegatronParallel

    return MegatronParallel()


def _attempt(run_dir: Path, rank: int) -> int:
    """The local launcher says which attempt this is; under torchrun/srun each rank works it out."""
    given = os.environ.get(rundir.ENV_ATTEMPT, "")
    if given.isdigit() and int(given) >= 1:
        return int(given)
    return rundir.rank_attempt(run_dir, rank)


def start_watchdog(ctx: RunContext) -> None:
    """The watchdog thread (``watchdog.enabled``), the collective-sequence check (``sequence_check``), the
    adaptive deadlines (``deadlines.step/checkpoint: auto``) and the straggler window.

    Both before the first phase: the watchdog must see init (communicator bootstrap can hang too).
    """
    from lifecycle.watchdog.core import Watchdog
    from lifecycle.watchdog.seqcheck import SequenceCheck

    cfg = ctx.policy.watchdog
    from lifecycle.context import ADAPTIVE, DeadlineBook
    from lifecycle.watchdog.adaptive import AdaptiveDeadline
    from lifecycle.watchdog.straggler import ComputeWindow

    ctx.deadlines = DeadlineBook(ctx.policy, {key: AdaptiveDeadline(key, ctx.policy.deadline(key), cfg.adaptive)
                                              for key in ADAPTIVE if ctx.policy.is_auto(key)})
    if cfg.straggler.action != "off":
        ctx.compute = ComputeWindow(cfg.straggler.window)
    if cfg.sequence_check:
        ctx.phase_hooks.append(SequenceCheck())
    if cfg.enabled:
        from lifecycle.recovery.inprocess import refusal

        ctx.watchdog = Watchdog(ctx, refusal=refusal).start()


def _drill_fired(events: EventLog, drill: FaultDrill) -> None:
    events.instant("fault_drill", action=drill.action, at=drill.at, drill_step=drill.step)
    events.flush()
