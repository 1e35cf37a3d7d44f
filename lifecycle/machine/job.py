"""One rank's engine inside a trainer's own loop: ``lifecycle.attach()`` returns a :class:`Job`.

The Job drives the same parts as ``lifecycle run``'s ranks — the orchestrator's phases and failure edge
(:class:`~lifecycle.machine.orchestrator.Orchestrator`), the step loop and its boundaries
(:class:`~lifecycle.phases.train.StepLoop`), the checkpoint commit protocol, the watchdog, teardown — but the
trainer keeps its loop::

    job = lifecycle.attach(overrides=["preset=moe"])   # every rank, after its own init if it has one
    job.watch(model, optimizer)                         # zero-token guard, DDP spans, checkpoints + resume
    for step in job.steps(total):                       # 1-based, after the resumed step
        train_step(...)                                 # the trainer's own step
    job.close()                                         # the policy's teardown

Errors of the caller (a layout that is not the policy's, ``attach`` twice, a closed job) raise a
:class:`~lifecycle.errors.LifecycleError` on every rank. Once the engine runs, a failure inside it — or an
exception leaving ``with lifecycle.attach(...) as job:`` — takes the failure edge exactly as under ``lifecycle
run``: abort, the hang report, and the process leaves with the policy's exit code.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, NoReturn

from lifecycle.errors import JobFailed, LifecycleError, PolicyError, PolicyIssue, UsageError
from lifecycle.phases.train import Decision, StepLoop

if TYPE_CHECKING:
    from torch.nn import Module

    from lifecycle.context import RunContext
    from lifecycle.distributed.parallel import ParallelState
    from lifecycle.machine.orchestrator import Orchestrator
    from lifecycle.moe.zero_token import ZeroTokenGuard
    from lifecycle.policy.schema import Policy

log = logging.getLogger(__name__)
_active: Job | None = None
"""The one open Job of this process."""
BETWEEN = "between_steps"
"""The span of a trainer's own loop from a boundary to its next step (bounded by ``watchdog.deadlines.eval``)."""
RESERVED_SPANS = frozenset({"step", "setup", "watch", "save", "commit", "resume", "verify", BETWEEN})
SUMMARY_WAIT_S = 5.0
"""How long rank 0 waits at close for every rank's exit event before it writes summary.json."""
FAILED_SUMMARY_WAIT_S = 1.5
"""The same after a failure (a rank that died writes no exit event: the wait would always run out)."""
_FAILED: dict[int, tuple[BaseException, int | None, BaseException | None]] = {}
"""Errors a Job took its failure edge for and passed on to the trainer: (error, exit code, the error as the
engine explained it), by ``id`` of the error (for :func:`_excepthook`)."""


def attach(config_name: str | None = None, config_dir: str | Path | None = None, overrides: Sequence[str] = (),
           run_dir: str | Path | None = None) -> Job:
    """Compose and validate the policy as the CLI does, prepare the run directory, adopt or create the process
    groups, start the watchdog, run init and warmup; the :class:`Job`. Every rank calls it, in the same order
    relative to its other collectives (it issues collectives on the default group and on every warmed group).

    ``run_dir`` overrides ``run.dir``. When the trainer already called ``init_process_group`` (and megatron's
    ``initialize_model_parallel``), they are adopted: the live layout must be the policy's ``parallelism``.
    Otherwise both are created from the policy and the launcher's environment (torchrun, srun).
    """
    global _active
    _install_excepthook()  # an error of attach itself, uncaught, is one line and its exit code too
    if _active is not None and not _active.closed:
        raise UsageError("lifecycle.attach() was called twice in this process: use the Job it returned (close() it "
                         "before attaching again)")
    from lifecycle.machine.rankdir import prepare_rank_dir
    from lifecycle.machine.session import build_context
    from lifecycle.policy.load import load

    rank, world, local_rank = _ranks()
    every = [*overrides, *([f"run.dir={run_dir}"] if run_dir is not None else [])]
    policy = _fitted(load(every, config_dir=config_dir, config_name=config_name or "config", own_loop=True).policy,
                     rank)
    parallel = _adopted_parallel(policy, world)
    path = prepare_rank_dir(policy, rank, world, every, hint="run_dir= or run.id=")
    ctx = build_context(policy, path, rank, world, local_rank, parallel, own_loop=True)
    _warn_fresh_run_dir(policy, rank, run_dir)
    job = Job(ctx)
    _active = job
    job._begin()
    return job


def _fitted(policy: Policy, rank: int) -> Policy:
    """Under a trainer's own default group: the deadlines nobody set fitted under its timeout (torch's default unless
    the trainer chose one), the same on every rank (:func:`lifecycle.policy.timeouts.fit_to_group_timeout`)."""
    from lifecycle.phases.init import default_group_timeout_s
    from lifecycle.policy.timeouts import fit_to_group_timeout

    seconds = default_group_timeout_s()
    if seconds is None:
        return policy
    fitted, moved = fit_to_group_timeout(policy, seconds)
    if moved and rank == 0:
        log.info("deadlines fitted under the trainer's process-group timeout (%gs): %s", seconds,
                 ", ".join(f"watchdog.deadlines.{n} {a:g}s -> {b:g}s" for n, (a, b) in moved.items()))
    return fitted


def _warn_fresh_run_dir(policy: Policy, rank: int, given: str | Path | None) -> None:
    """A run directory named after ``torchrun --standalone``'s random rendezvous id is new at every launch: running
    the same command again would not resume. Say so once, with what to pass."""
    import re

    rid = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rank != 0 or given is not None or policy.run.id != rid or not re.fullmatch(r"[0-9a-f-]{32,36}", rid):
        return
    log.warning("run directory %s is named after torchrun's random rendezvous id (--standalone): a new one at each "
                "launch, so running the same command again starts over; pass run_dir=... to attach(), or run.id=... "
                "(or torchrun --rdzv-id) to resume from the last committed checkpoint", policy.run.dir)


def _ranks() -> tuple[int, int, int]:
    """(rank, world, local rank): from the live default group, else from the launcher's environment."""
    import torch.distributed as dist

    from lifecycle.machine.preflight import check_rendezvous_env, rank_env

    local = os.environ.get("LOCAL_RANK", "0")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(local) if local.isdigit() else 0
    missing = [n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
    if missing:
        raise UsageError(f"lifecycle.attach(): no process group and no launcher environment ({', '.join(missing)} "
                         f"not set); start the trainer under torchrun or srun, or call "
                         f"torch.distributed.init_process_group before attach()")
    ranks = rank_env()
    check_rendezvous_env()
    return ranks


def _adopted_parallel(policy: Policy, world: int) -> ParallelState:
    """The model-parallel backend: megatron's live groups when the trainer made them (checked against the
    policy, the same on every rank: no collective, no hang), else what the policy's train kind asks for."""
    from lifecycle.machine.session import parallel_for
    from lifecycle.policy.checks import world_issues

    issues = world_issues(policy, world)
    if issues:
        raise PolicyError(issues, source=f"world size {world}")
    if "megatron.core" not in sys.modules:
        return parallel_for(policy)
    from lifecycle.backends.megatron.parallel import MegatronParallel, is_initialized, live_layout

    if not is_initialized():
        return parallel_for(policy)
    par = policy.parallelism
    want = {"tp": par.tp, "pp": par.pp, "cp": par.cp, "ep": par.ep, "etp": par.expert_tp, "vpp": par.vpp or 1,
            "dist_opt_instances": par.dist_opt_instances}
    live = live_layout()
    wrong = [PolicyIssue(f"parallelism.{k}", f"the trainer's model-parallel groups have {k}={live[k]}, the policy "
                         f"{want[k]}; set parallelism.{k}={live[k]} (or initialize the groups with {k}={want[k]})",
                         has_value=False) for k in want if live[k] != want[k]]
    if wrong:
        raise PolicyError(wrong, source="the live layout of megatron's parallel_state")
    return MegatronParallel()


def _modules(model: object) -> list[Module]:
    import torch

    chunks = list(model) if isinstance(model, list | tuple) else [model]
    bad = [type(c).__name__ for c in chunks if not isinstance(c, torch.nn.Module)]
    if not chunks or bad:
        raise UsageError(f"job.watch(model): model must be a torch module, megatron DDP or a list of model chunks "
                         f"(got {type(model).__name__}{f' holding {bad}' if bad and chunks != [model] else ''})")
    return chunks


class Job:
    """One rank's lifecycle inside a trainer's loop (see the module docstring). Made by :func:`attach`."""

    def __init__(self, ctx: RunContext) -> None:
        from lifecycle.machine.orchestrator import Orchestrator

        self.ctx = ctx
        self.machine: Orchestrator = Orchestrator(ctx)
        self.loop = StepLoop(None)  # lifecycle's own checkpoints once a model is watched
        self.closed = False
        self.exit_code: int | None = None
        self._watched = False
        self._checkpoints = False
        self._guard: ZeroTokenGuard | None = None
        self._started = False
        self._steps: Generator[int, None, None] | None = None
        self._dying = False
        self._failed: BaseException | None = None
        self._restore_signals: Callable[[], None] | None = None
        self._setup_open = False
        self._setup_t0 = 0.0
        self._between: float | None = None

    # ---- the public face ---------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def run_dir(self) -> Path:
        return self.ctx.run_dir

    @property
    def start_step(self) -> int:
        """The last step already done: 0 for a new run, the resumed checkpoint's step after ``watch``."""
        return self.ctx.progress.resumed_from or 0

    @property
    def should_stop(self) -> bool:
        """Every rank agreed to stop (preemption): save and leave the loop."""
        return self.ctx.progress.stop.stop_step is not None

    def watch(self, model: object, optimizer: object = None, *, checkpoints: bool = True) -> Job:
        """Guard the model's zero-token MoE ranks (``moe.zero_token``), record megatron DDP bucket collectives as
        spans, and (``checkpoints``) register model + optimizer for lifecycle's checkpoints and resume from the last
        committed one (``checkpoint.resume``). A trainer that keeps its own save and load passes
        ``checkpoints=False`` and wraps its save in :meth:`checkpoint`. Every rank calls it once, before the first
        step (resume is collective on the default group)."""
        self._open("watch")
        chunks = _modules(model)
        if self._watched:
            raise UsageError("job.watch() was called already: watch every model chunk in one call (a list)")
        self._watched = True
        self._checkpoints = checkpoints
        self._run(lambda: self._watch(chunks, optimizer))
        return self

    def steps(self, total: int) -> Generator[int, None, None]:
        """Yield the steps after :attr:`start_step` up to ``total`` (1-based), each inside its step span; between
        two steps, what ``lifecycle run`` does (stop flag, barriers, checkpoint cadence); the final checkpoint
        at the end. Every rank iterates the same steps."""
        self._open("steps")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise UsageError(f"job.steps(total): total must be an integer >= 0 (got {total!r})")
        if not self._watched:
            raise UsageError("job.steps() before job.watch(): lifecycle resumes from the last committed checkpoint and "
                             "saves at the policy's cadence only for a watched model; call job.watch(model, optimizer) "
                             "first (job.watch(model, checkpoints=False) when the trainer saves and loads itself)")
        if self._steps is not None:
            raise UsageError("job.steps() was called already: one step loop per Job")
        if total <= self.start_step:
            log.warning("job.steps(%d): nothing to train, the run is at step %d already (resumed)", total,
                        self.start_step)
        if not self._run(self._before_first_step):
            return _no_steps()
        self._steps = self.loop.steps(self.ctx, total)
        return self._guarded(self._steps)

    @contextmanager
    def step(self, n: int) -> Iterator[None]:
        """One step span (deadline, drills, compute time) for trainers that keep their loop; then call
        :meth:`boundary`."""
        self._open("step")
        if not self._started:
            self._run(self._before_first_step)
        self._end_between()
        with self.loop.step(self.ctx, n):
            yield

    def report(self, **metrics: float) -> None:
        """Metrics of the running step (``loss``; ``wait_s``: time spent waiting on peers, not compute)."""
        self._open("report")
        self.loop.report(**metrics)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The trainer's own work outside its steps — evaluation, logging, callbacks — as a span named ``name``
        bounded by ``watchdog.deadlines.eval`` (learned when ``auto``) instead of the step deadline: a long
        evaluation is no hang, and a hang inside it is named within that deadline. Inside a step or between steps;
        local (no collective): only the ranks that run it enter it. Its time is not counted as step time."""
        self._open("phase")
        if not isinstance(name, str) or not name.isidentifier() or name in RESERVED_SPANS:
            raise UsageError(f"job.phase(name): name must be a word (letters, digits, _) that is not one of lifecycle's "
                             f"own spans {sorted(RESERVED_SPANS)} (got {name!r})")
        t0 = time.monotonic()
        # Its own group: only this rank's (ranks may run it or not), never counted as an op every rank runs.
        with self.ctx.events.span(name, deadline="eval", group="trainer", ranks=[self.ctx.rank]):
            yield
        took = time.monotonic() - t0
        self.loop.outside_step_s += took
        self.ctx.deadlines.observe("eval", took)

    def boundary(self, n: int) -> Decision:
        """After step ``n`` on every rank: the stop flag, barrier points, lifecycle's checkpoint when one is due
        and a model is watched. ``save`` says a checkpoint is due (the trainer's own, with :meth:`checkpoint`,
        when nothing is watched); ``stop`` says every rank agreed to stop."""
        self._open("boundary")
        if not self._started and not self._run(self._before_first_step):
            return Decision(save=False, stop=True)
        self._end_between()
        self.ctx.progress.step = n
        decision = self._run(lambda: self.loop.boundary(self.ctx, n))
        decision = decision if decision is not None else Decision(False, False)
        if not decision.stop:  # what the trainer does until its next step is its own (logging, evaluation)
            self._begin_between()
        return decision

    def save(self, n: int | None = None) -> None:
        """Lifecycle's own checkpoint of the watched model now (two-phase commit). Every rank calls it."""
        self._open("save")
        if not self._checkpoints:
            raise UsageError("job.save(): no model is watched for lifecycle's checkpoints; call job.watch(model, "
                             "optimizer) first, or wrap the trainer's own save in job.checkpoint(n, path)")
        if n is not None:
            self.ctx.progress.step = n
        between = self._end_between()
        self._run(lambda: self.loop.save_now(self.ctx, "requested"))
        if between:
            self._begin_between()

    @contextmanager
    def checkpoint(self, n: int, path: str | Path | None = None) -> Iterator[Path | None]:
        """Wrap the trainer's own save of step ``n``: bounded by the checkpoint deadline; completion agreed over
        the store (late ranks named); with ``path`` (the ``iter_NNNNNNN`` folder the trainer wrote) rank 0 then
        commits it: manifest, fsync, trackers. Every rank enters it at the same step."""
        from lifecycle.phases.checkpoint import TrainerSave

        self._open("checkpoint")
        between = self._end_between()
        save = TrainerSave(self.ctx, self.machine, n, Path(path) if path is not None else None)
        self._run(save.begin)
        yield save.path
        self._run(save.commit)
        self.loop.saved_at = n
        if between:  # back to the trainer's own time until its next step
            self._begin_between()

    def close(self) -> int:
        """The policy's teardown (success path); safe twice (the second call returns the first one's code). Returns
        0; a teardown that fails raises :class:`~lifecycle.errors.JobFailed` carrying the policy's exit code. Groups
        the trainer made before :func:`attach` are left to it (its own ``destroy_process_group`` follows)."""
        global _active
        if self.closed:
            return self.exit_code or 0
        self.closed = True
        self._end_setup()
        if self._steps is not None:
            self._steps.close()
        try:
            self.loop.finish(self.ctx, save=self._checkpoints)
        except BaseException as exc:  # noqa: BLE001 - the failure edge, then to the trainer
            self._fail_part(exc)
            raise
        self.exit_code = self.machine.finish()
        self._after()
        _active = None
        if self.exit_code:
            raise JobFailed(f"lifecycle's teardown failed on rank {self.rank} (exit code {self.exit_code}); see "
                            f"{self.run_dir}", code=self.exit_code, phase="teardown", rank=self.rank)
        return self.exit_code

    def fail(self, exc: BaseException) -> NoReturn:
        """Take the failure edge for ``exc`` (abort, report) and leave the process now with the policy's exit code
        (no ``finally``, no atexit: for a trainer that must not run on). After :meth:`close` it is a UsageError,
        like every call but ``close`` itself (safe twice)."""
        if self.closed:
            self._open("fail")
        self._fail_part(exc)
        self._leave(self.exit_code or 1)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """No exception, or ``sys.exit(0)`` (a trainer's own clean exit): :meth:`close`. Any other exception:
        lifecycle's part of the failure edge (report, alarm to the peers, its own groups), then the exception goes
        on to the trainer (its ``finally`` blocks and atexit run; uncaught, the process leaves with the policy's
        exit code: :func:`_excepthook`)."""
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.close()
        elif not self.closed:
            self._fail_part(exc)

    # ---- internals ---------------------------------------------------------------------------------------
    def _begin(self) -> None:
        from lifecycle.machine.session import install_signals, start_watchdog

        if threading.current_thread() is threading.main_thread():
            self._restore_signals = install_signals(self.ctx, self.machine, own_loop=True)
        else:
            log.warning("lifecycle.attach() outside the main thread: preemption signals are not handled")
        start_watchdog(self.ctx)
        self._run(self.machine.begin)
        # The trainer's set-up (model, load_checkpoint, data iterators) up to its first step: under its own deadline,
        # never the step's.
        self.ctx.events.emit("begin", "setup", handler="trainer", deadline="setup")
        self._setup_open = True
        self._setup_t0 = time.monotonic()

    def _end_setup(self) -> None:
        if self._setup_open:
            self._setup_open = False
            self.ctx.events.emit("end", "setup", handler="trainer", deadline="setup",
                                 dur_us=int((time.monotonic() - self._setup_t0) * 1e6))
        self._end_between()

    def _end_between(self) -> bool:
        """The trainer's time since the last boundary of its own loop (:meth:`boundary`) ends; whether it ran."""
        if self._between is None:
            return False
        t0, self._between = self._between, None
        self.ctx.events.emit("end", BETWEEN, deadline="eval", dur_us=int((time.monotonic() - t0) * 1e6))
        self.ctx.deadlines.observe("eval", time.monotonic() - t0)
        return True

    def _begin_between(self) -> None:
        """The trainer's own time until its next step (after a boundary, or a save between two steps): under
        ``watchdog.deadlines.eval``, never the step deadline."""
        self.ctx.events.emit("begin", BETWEEN, deadline="eval")
        self._between = time.monotonic()

    def _watch(self, chunks: list[Module], optimizer: object) -> None:
        ctx = self.ctx
        with ctx.events.span("watch", chunks=len(chunks), deadline="setup"):
            from lifecycle.backends.megatron.watched import WatchedMegatron, is_megatron
            from lifecycle.backends.watched import WatchedModules

            megatron = "megatron.core" in sys.modules and is_megatron(chunks, optimizer)
            if self._checkpoints:
                ctx.step_handler = WatchedMegatron(chunks, optimizer) if megatron else WatchedModules(chunks,
                                                                                                      optimizer)
                self.loop.checkpoint = self.machine.checkpoint
            self._guard = _zero_token_guard(ctx, self.loop, chunks)
            if "megatron.core" in sys.modules and all(hasattr(c, "ddp_config") for c in chunks):
                from lifecycle.backends.megatron.step import record_collectives

                record_collectives(ctx)
        if self._checkpoints:
            from lifecycle.phases.train import after_resume
            from lifecycle.recovery.resume import resume_tiers

            if resume_tiers(ctx):
                after_resume(ctx)

    def _before_first_step(self) -> bool:
        """The stop-flag agreement before training (as ``lifecycle run``); False: stop before the first step."""
        from lifecycle.phases.train import agree_stop

        self._end_setup()
        if self._started:
            return not self.loop.stopped
        self._started = True
        self.loop.start(self.ctx, None)  # job.steps(total) sets the last step; a trainer's own loop never says
        if self.ctx.policy.checkpoint.on_signal and agree_stop(self.ctx):
            log.warning("preemption signal before training: stopping without a checkpoint")
            self.ctx.progress.stop.stop_step = self.ctx.step
            self.loop.stopped = True
            return False
        return True

    def _guarded(self, steps: Generator[int, None, None]) -> Generator[int, None, None]:
        """The step loop; an error inside lifecycle's own part of it takes the failure edge, then goes on."""
        try:
            yield from steps
        except GeneratorExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - the failure edge
            self._fail_part(exc)
            raise

    def _run(self, fn):  # type: ignore[no-untyped-def]
        """``fn()``; a failure inside the engine takes the failure edge, then goes on to the trainer."""
        try:
            return fn()
        except BaseException as exc:  # noqa: BLE001 - the failure edge
            self._fail_part(exc)
            raise

    def _open(self, what: str) -> None:
        if self._failed is not None:
            raise UsageError(f"job.{what}(): this Job failed ({type(self._failed).__name__}) and took its failure "
                             f"edge; attach again for a new attempt")
        if self.closed:
            raise UsageError(f"job.{what}(): this Job is closed (its teardown ran); attach again for a new run")

    def _fail_part(self, exc: BaseException) -> None:
        """Lifecycle's part of the failure edge for ``exc``, once: the step span ends with it, the peers are told,
        the hang report, lifecycle's own groups and handlers torn down (never the trainer's), the summary. Then the
        caller raises ``exc`` on to the trainer. A second Ctrl-C cannot cut it short (its hard deadline bounds it)."""
        global _active
        if self._failed is not None or self._dying:
            return
        self._failed = exc
        self._dying = self.closed = True
        with _sigint_ignored():
            if self._steps is not None:  # the step span ends with this error
                try:
                    self._steps.throw(exc)
                except BaseException:  # noqa: BLE001 - it is the same error
                    pass
            self.exit_code = self.machine.fail(exc)
            self._after(failed=True)
        _active = None
        _FAILED[id(exc)] = (exc, self.exit_code, self.machine.error)

    def _after(self, *, failed: bool = False) -> None:
        """Remove the zero-token hooks, stop the watchdog; rank 0 writes summary.json and the timeline (as the local
        launcher does; after a failure without the picture: `lifecycle timeline RUN_DIR` draws it)."""
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.remove()
        restore, self._restore_signals = self._restore_signals, None
        if restore is not None and threading.current_thread() is threading.main_thread():
            restore()
        if self.ctx.watchdog is not None:
            self.ctx.watchdog.stop()
        if self.ctx.rank == 0:
            from lifecycle.machine.rankdir import release_run_dir

            _write_summary(self.ctx, failed=failed)
            release_run_dir(self.ctx.run_dir)

    @staticmethod
    def _leave(code: int) -> NoReturn:
        # As lifecycle run's ranks: interpreter shutdown could wait on threads or groups a dead peer left blocked.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _no_steps() -> Generator[int, None, None]:
    yield from ()


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ctrl-C is ignored while lifecycle's failure edge runs (bounded by teardown's hard deadline): a second Ctrl-C
    must not leave it half done (no summary, a deep traceback). Main thread only, where Python handles signals."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _install_excepthook() -> None:
    """An exception that leaves the trainer's program uncaught after lifecycle took its failure edge (or that a
    Job still open never saw: the recipe's explicit-close form) ends the process with the policy's exit code: a
    lifecycle error as one line, the trainer's own error with its traceback (its bug), then the atexit handlers,
    then exit. Any other exception goes to the hook that was there before."""
    previous = sys.excepthook
    if getattr(previous, "_lifecycle", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        job = _active
        if id(exc) not in _FAILED and job is not None and not job.closed:
            try:
                job._fail_part(exc)
            except BaseException:  # noqa: BLE001 - the error being reported is the one that counts
                pass
        if id(exc) not in _FAILED and not isinstance(exc, LifecycleError):
            previous(kind, exc, tb)
            return
        failed, code, explained = _FAILED.get(id(exc), (exc, None, exc))
        shown = explained if isinstance(explained, LifecycleError) else failed
        if isinstance(shown, LifecycleError):
            where = f" on rank {shown.rank}" if shown.rank is not None else ""
            print(f"lifecycle: {type(shown).__name__}{where}: {shown}", file=sys.stderr, flush=True)
        else:
            previous(kind, exc, tb)
        _exit_after_atexit(code if code is not None else _code_of(shown))

    hook._lifecycle = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _code_of(exc: BaseException) -> int:
    from lifecycle.errors import exit_code

    return exit_code(exc)


def _exit_after_atexit(code: int) -> NoReturn:
    """Run the atexit handlers (the trainer's logger flushes included), then leave with ``code`` without the
    interpreter's shutdown, which could wait on threads a dead peer left blocked in a collective."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        Job._leave(code)


def _zero_token_guard(ctx: RunContext, loop: StepLoop, chunks: list[Module]) -> ZeroTokenGuard | None:
    action = ctx.policy.moe.zero_token.action
    if action == "off":
        return None
    from lifecycle.moe import install_zero_token_guard

    def on_event(layer: str, step: int | None, total: int) -> None:
        ctx.events.instant("zero_token", layer=layer, step=step, count=1, total=total, action=action)

    guard = install_zero_token_guard([getattr(c, "module", c) for c in chunks], action, rank=ctx.rank,
                                     on_event=on_event)
    loop.on_step.append(guard.set_step)
    return guard


def _write_summary(ctx: RunContext, *, failed: bool = False) -> None:
    """Rank 0, after its own exit event: wait (bounded) for every rank's, then summary.json and the timeline (not
    drawn after a failure: the exit code is not held back for a picture)."""
    from lifecycle.obs import summary
    from lifecycle.obs.events import read_events
    from lifecycle.obs.timeline import end_of_job

    ends = time.monotonic() + (FAILED_SUMMARY_WAIT_S if failed else SUMMARY_WAIT_S)
    while time.monotonic() < ends:
        events = read_events(ctx.run_dir)
        if all(any(e.get("name") == "exit" for e in events.get(r, [])) for r in range(ctx.world_size)):
            break
        time.sleep(0.1)
    try:
        info = summary.build(ctx.run_dir)
        summary.write(ctx.run_dir, info)
        if failed:
            print(f"trace    not drawn after a failure: `lifecycle timeline {ctx.run_dir}` draws it", flush=True)
        else:
            end_of_job(ctx.run_dir, ctx.policy.run.timeline)
    except Exception as exc:  # noqa: BLE001 - a report must not fail a finished run
        log.warning("summary not written: %s", exc)
