"""Train: build the step handler, resume, run the steps; barrier points, checkpoints and preemption
happen at step boundaries, in the same order on every rank.

:class:`StepLoop` is the one place that wraps a step (span, drills, deadlines, compute times) and decides what
happens between two steps; the built-in kinds (:class:`TrainPhase`) and a trainer's own loop
(:class:`lifecycle.machine.job.Job`) both run their steps through it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import closing, contextmanager
from typing import TYPE_CHECKING, NamedTuple

from lifecycle.context import ADAPTIVE
from lifecycle.phases.base import Action, GroupView, deadline_text, sequence_check
from lifecycle.phases.points import run_point
from lifecycle.policy import registry

if TYPE_CHECKING:
    from lifecycle.context import RunContext
    from lifecycle.handlers.protocols import StepHandler
    from lifecycle.policy.schema import Policy

log = logging.getLogger(__name__)

SIGNAL_CHECK_S = 0.5
"""``checkpoint.signal_check_every: auto``: the stop flag about this often, in seconds of training."""
SIGNAL_CHECK_MAX = 50
"""``auto``: at most this many steps between two agreements."""


class StopFlag:
    """The stop flag's max-reduce over the default group, issued now and read later: every rank must issue it
    at the same point and read it at the same point.

    One float says "a preemption signal arrived on some rank"; the same all-reduce carries each rank's proposals
    for the adaptive deadlines (``auto``): every rank then uses the maximum, with no collective of its own.
    Issued at one step boundary and read at the next, the all-reduce runs while the step computes instead of
    on the training thread's path (``checkpoint.signal_overlap``). Its last value is each rank's recent step time
    (``step_s``; 0: not known yet): the maximum sets ``signal_check_every: auto``'s cadence alike on every rank.
    """

    def __init__(self, ctx: RunContext, *, issued_at: int | None, step_s: float = 0.0) -> None:
        import torch
        import torch.distributed as dist

        from lifecycle.distributed.collectives import device_for

        values = [1.0 if ctx.progress.stop.preempt_signal else 0.0, *ctx.deadlines.proposals(), step_s]
        self.issued_at = issued_at
        self.step_s = 0.0
        """The slowest rank's step time, once read."""
        self.flag = torch.tensor(values, dtype=torch.float64, device=device_for())
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        ctx.ops.count("world")

    def read(self, ctx: RunContext, *, overlapped: bool) -> bool:
        """Wait (bounded by the step deadline) and apply the agreed deadlines; True: some rank was signalled."""
        from lifecycle.distributed.collectives import wait_works

        extra = {"overlapped": True, "issued_at": self.issued_at} if overlapped else {}
        with ctx.events.span("stop_flag", group="world", **extra):
            wait_works([self.work], "all_reduce(stop flag)", "world", list(range(ctx.world_size)),
                       ctx.deadline("step"), time.monotonic())
        agreed = self.flag.cpu().tolist()
        ctx.agree_deadlines(agreed[1:-1])
        self.step_s = float(agreed[-1])
        return bool(agreed[0])


def agree_stop(ctx: RunContext) -> bool:
    """Issue the stop flag and read it at once (collective on the default group)."""
    return StopFlag(ctx, issued_at=ctx.step).read(ctx, overlapped=False)


def auto_cadence(step_s: float) -> int:
    """``signal_check_every: auto``: the steps between two agreements for the slowest rank's step time (1 while it
    is not known)."""
    if step_s <= 0.0:
        return 1
    return max(1, min(SIGNAL_CHECK_MAX, int(SIGNAL_CHECK_S / step_s)))


def leave_for_restart(ctx: RunContext) -> None:
    """A peer failed and the ranks restart in place (the watchdog saw its alarm): leave the phase now, between two
    collectives, rather than at the next collective with that peer."""
    request = ctx.watchdog.restart_request if ctx.watchdog is not None else None
    if request is not None:
        from lifecycle.errors import RestartRequested

        raise RestartRequested(f"restarting in place: {getattr(request, 'detail', request)}", phase=ctx.events.phase,
                               rank=ctx.rank)


def _poison(handler: object, action: str) -> None:
    """A ``nan_weights`` drill: a NaN in the first floating parameter of the step handler's model (the built-in kinds' and a
    watched trainer's modules); ``perturb_weights``: that value moved by 1e-3 instead."""
    import torch

    state = getattr(handler, "state", None)
    modules = [getattr(handler, "model", None), *(getattr(handler, "chunks", None) or []),
               *(getattr(state, "chunks", None) or [])]
    for module in modules:
        if isinstance(module, torch.nn.Module):
            for param in module.parameters():
                if param.is_floating_point():
                    with torch.no_grad():
                        if action == "perturb_weights":
                            param.view(-1)[0] += 1e-3
                        else:
                            param.view(-1)[0] = float("nan")
                    log.warning("FAULT DRILL: %s in a parameter of shape %s", action, tuple(param.shape))
                    return


class Decision(NamedTuple):
    """What a step boundary decided: ``save`` (a checkpoint is due at this step: taken already when lifecycle
    saves the model itself) and ``stop`` (every rank agreed to stop after this step)."""

    save: bool
    stop: bool


Checkpoint = Callable[["RunContext", str], None]


class StepLoop:
    """Steps and the boundaries between them, in the same order on every rank.

    ``checkpoint(ctx, reason)`` takes lifecycle's own checkpoint; with None (a trainer that saves by itself) a
    due save is only reported in the :class:`Decision`.
    """

    def __init__(self, checkpoint: Checkpoint | None) -> None:
        self.checkpoint = checkpoint
        self.saved_at: int | None = None
        self.flag: StopFlag | None = None
        """The stop flag issued at the last step boundary, read at the next one (signal_overlap)."""
        self.total: int | None = None
        """The last step of this run (the policy's ``train.steps`` or ``job.steps(total)``)."""
        self.stopped = False
        self.on_step: list[Callable[[int], None]] = []
        """Called with the step number as each step begins (the zero-token guard's step)."""
        self._metrics: dict[str, float] = {}
        self._traced = False
        self.outside_step_s = 0.0
        """Time of the running step spent in a trainer's own phases (``job.phase``): not step time."""
        self.check_at = 0
        """``signal_check_every: auto``: the first step boundary that issues the stop flag again."""
        self.period = 0.0
        """This rank's last step period (begin to begin, the boundary included; 0 before the second step)."""
        self._began: float | None = None

    def start(self, ctx: RunContext, total: int | None) -> None:
        """Before the first step (after any resume): a resumed step counts as saved."""
        self.total = total
        persisted = ctx.progress.resumed_from is not None and ctx.progress.resumed_tier != "memory"
        self.saved_at = ctx.step if persisted else None

    def report(self, **metrics: float) -> None:
        """Metrics of the step running now (``loss``; ``wait_s``, the time spent waiting on peers)."""
        self._metrics.update(metrics)

    @contextmanager
    def step(self, ctx: RunContext, step: int) -> Iterator[None]:
        """One step span: drills, the step deadline (the watchdog), compute time for stragglers and ``auto``."""
        ctx.events.step = step
        leave_for_restart(ctx)
        for hook in self.on_step:
            hook(step)
        ctx.drills.fire("train", step=step)
        if ctx.drills.poisoned:
            action, ctx.drills.poisoned = ctx.drills.poisoned, None
            _poison(ctx.step_handler, action)
        self._metrics = {}
        self.outside_step_s = 0.0
        t0 = time.monotonic()
        if self._began is not None:
            self.period = t0 - self._began
        self._began = t0
        with ctx.events.span("step") as extra, self._first_step_trace(ctx):
            slow = ctx.drills.slow_s(step)
            if slow:
                time.sleep(slow)  # a `slow` drill: extra compute on this rank (a straggler)
            yield
            took = max(time.monotonic() - t0 - self.outside_step_s, 0.0)
            compute = max(took - float(self._metrics.get("wait_s", 0.0)), 0.0)
            extra.update(self._metrics, compute_s=round(compute, 6))
        ctx.deadlines.observe("step", took)
        if ctx.compute is not None:
            ctx.compute.add(compute)
        ctx.progress.step = step
        loss = self._metrics.get("loss")
        ctx.progress.last_loss = float(loss) if isinstance(loss, int | float) else None
        if ctx.progress.restored is not None:
            from lifecycle.recovery.state_check import check_restored

            restored, ctx.progress.restored = ctx.progress.restored, None
            check_restored(ctx, step, ctx.progress.last_loss, restored)

    @contextmanager
    def _first_step_trace(self, ctx: RunContext) -> Iterator[None]:
        """The first step of this process runs traced: which communicators it used (event ``groups_used``) and
        which of them warmup did not connect (``unwarmed``: each connected inside the step, at its memory peak)."""
        if self._traced:
            yield
            return
        self._traced = True
        from lifecycle.distributed import groups, tracing

        with tracing.trace() as seen:
            yield
        used, unwarmed = groups.used_by(ctx.parallel, seen.calls, seen.groups, ctx.comms.groups)
        if not ctx.policy.warmup.enabled:
            unwarmed = []
        ctx.events.instant("groups_used", groups=used, unwarmed=unwarmed)
        if unwarmed:
            log.warning("step %d used communicator(s) that warmup did not warm: %s; they connected inside the step, "
                        "at its memory peak — add them to warmup.groups (or use warmup.groups: used)",
                        ctx.events.step, ", ".join(unwarmed))

    def steps(self, ctx: RunContext, total: int) -> Generator[int, None, None]:
        """Yield each step after ``ctx.step`` up to ``total`` inside its step span, then run its boundary; the
        checkpoint at the end (``checkpoint.at_end``). Every rank iterates the same steps."""
        self.start(ctx, total)
        for step in range(ctx.step + 1, total + 1):
            with self.step(ctx, step):
                yield step
            if self.boundary(ctx, step).stop:
                return
        self.end(ctx)

    def end(self, ctx: RunContext) -> None:
        """After the last step: the final checkpoint unless this step is saved already."""
        ctx.events.step = None
        if ctx.policy.checkpoint.at_end and self.saved_at != ctx.step and ctx.step > 0:
            self._save(ctx, "end")
        self.commit_pending(ctx)  # before teardown, whose hard deadline is not the checkpoint's

    def commit_pending(self, ctx: RunContext) -> None:
        """Commit the async save still pending, in the checkpoint phase: judged by the checkpoint deadline, not by
        the (maybe learned, seconds-short) step deadline."""
        if ctx.progress.pending_save is None:
            return
        from lifecycle.phases.checkpoint import ASYNC_COMMIT, finish_pending

        if self.checkpoint is not None:
            self.checkpoint(ctx, ASYNC_COMMIT)
        else:
            finish_pending(ctx)

    def finish(self, ctx: RunContext, *, save: bool) -> None:
        """A trainer's loop ended: read a stop flag still in flight (every rank issued it), then the final
        checkpoint when ``save`` (a watched model) and no stop saved it already."""
        flag, self.flag = self.flag, None
        if flag is not None:
            flag.read(ctx, overlapped=True)
        if save and not self.stopped:
            self.end(ctx)

    def save_now(self, ctx: RunContext, reason: str) -> None:
        """A checkpoint of the current step, asked for by the trainer."""
        self._save(ctx, reason)

    def _save(self, ctx: RunContext, reason: str) -> None:
        if self.checkpoint is not None:
            self.checkpoint(ctx, reason)
        self.saved_at = ctx.step

    def _read(self, ctx: RunContext, flag: StopFlag, step: int, *, overlapped: bool) -> bool:
        """Read ``flag`` at the boundary of ``step``; with ``signal_check_every: auto`` the next issue falls where
        the next read comes about :data:`SIGNAL_CHECK_S` later (the same step on every rank: from agreed values)."""
        self.flag = None
        stop = flag.read(ctx, overlapped=overlapped)
        if ctx.policy.checkpoint.signal_check_every == "auto":
            self.check_at = step + auto_cadence(flag.step_s) - (1 if ctx.policy.checkpoint.signal_overlap else 0)
        return stop

    def boundary(self, ctx: RunContext, step: int) -> Decision:
        """Everything that happens between two steps, in the same order on every rank (collective on the default
        group when the stop flag is due, and on the groups of the barrier points and checkpoints)."""
        ck, every = ctx.policy.checkpoint, ctx.policy.barriers.every_n_steps
        leave_for_restart(ctx)
        stop = False
        if self.flag is not None:  # issued at the last boundary, reduced while this step ran
            stop = self._read(ctx, self.flag, step, overlapped=True)
        if ctx.progress.pending_save is not None:  # an async save overlapped this step: commit it now, in the checkpoint phase
            self.commit_pending(ctx)
        if every is not None and step % every.n == 0:
            run_point(ctx, f"every_{every.n}_steps", every, ctx.deadline("step"))
        save_step = bool(ck.every_steps and step % ck.every_steps == 0)
        if save_step:
            self._save(ctx, "periodic")
        mem = ck.memory.every_steps
        if mem and ctx.step_handler is not None:
            from lifecycle.recovery.memory import MemoryTier, tier

            live = ctx.comms.memory
            copies = tier(ctx) if step % mem == 0 else live if isinstance(live, MemoryTier) else None
            if copies is not None:
                copies.poll(ctx)  # the last copy's checks, once its thread is done: a refused one fails here
                if step % mem == 0:
                    copies.save(ctx, step)
        # The stop flag's all-reduce also carries the adaptive deadlines: with auto deadlines it runs even
        # when signals are not handled (its flag is then ignored).
        # checkpoint.signal_check_every trades that all-reduce on most steps for a later stop after a signal;
        # checkpoint.signal_overlap reads it one step later, except where the stop decides a save now (a
        # periodic-save step, the last step): there it is agreed at once, so a stop never saves twice.
        n = ck.signal_check_every
        due = (step >= self.check_at if n == "auto" else step % n == 0) or save_step
        last = self.total is not None and step >= self.total
        if not stop and due and (ck.on_signal or ctx.deadlines.learned):
            flag = StopFlag(ctx, issued_at=step, step_s=self.period)
            if ck.signal_overlap and not save_step and not last:
                self.flag = flag
            else:
                stop = self._read(ctx, flag, step, overlapped=False)
        if not (ck.on_signal and stop):
            return Decision(save=save_step, stop=False)
        ctx.progress.stop.stop_step = step
        self.stopped = True
        saving = self.saved_at != step
        if saving:
            self._save(ctx, "preemption")
        log.warning("preempted at step %d, saved", step)
        if ctx.rank == 0:
            print(f"preempted at step {step}, saved", flush=True)
        return Decision(save=save_step or saving, stop=True)


class TrainPhase:
    """The built-in kinds' train phase: a loop over :meth:`StepLoop.steps` calling the kind's ``step``."""

    phase = "train"

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.loop = StepLoop(checkpoint)

    def enabled(self, ctx: RunContext) -> bool:
        return True  # entered even with train.steps=0: the stop-flag agreement and teardown's order need it

    @staticmethod
    def plan(policy: Policy, view: GroupView | None = None) -> list[Action]:
        ck, dl = policy.checkpoint, policy.deadline("step")
        auto = any(policy.is_auto(p) for p in ADAPTIVE)
        flag = ck.on_signal or auto
        first = ([Action("stop_flag", "world", dl, "a preemption signal before the first step", when="on_signal")]
                 if ck.on_signal else [])
        if policy.train.steps == 0:
            return [*first, *sequence_check(policy, "train -> teardown")]
        actions = [*first, Action("setup", None, None, f"build the {policy.train.kind} model and optimizer")]
        if ck.resume != "never":
            when = "a committed checkpoint exists"
            if ck.verify == "digest":
                actions.append(Action("verify", None, policy.deadline("checkpoint"), "each rank checks the sha256 "
                                      "of its share of the files, then the ranks agree", when=when))
            actions.append(Action("resume", "world", policy.deadline("checkpoint"), f"resume={ck.resume}, "
                                  f"on_corrupt={ck.on_corrupt}; the ranks agree on the step loaded", when=when))
        actions.append(Action("step", "world", dl, f"{policy.train.kind} x {policy.train.steps}, deadline "
                              f"{deadline_text(policy, 'step')} per step"))
        every = policy.barriers.every_n_steps
        if every is not None:
            actions.append(Action(f"barrier:every_{every.n}_steps", every.group, every.timeout_s or dl,
                                  when=f"every {every.n} steps"))
        if flag:
            carries = " and ".join(w for w in ("the preemption flag" if ck.on_signal else "",
                                               "the auto deadlines" if auto else "") if w)
            n = ck.signal_check_every
            cadence = ("every step" if n == 1 else f"every {n} steps" if n != "auto" else
                       f"about every {SIGNAL_CHECK_S:g}s of steps (auto: n from the slowest rank's step time, at most "
                       f"{SIGNAL_CHECK_MAX})")
            how = ("issued at a step's end, read at the next one's (overlapped; save steps and the last step at "
                   "once)" if ck.signal_overlap else "read at once")
            actions.append(Action("stop_flag", "world", dl, f"max all-reduce of {carries}, {cadence}, {how}"))
        if policy.moe.zero_token.action != "off":
            actions.append(Action("zero_token_guard", "ep", None, policy.moe.zero_token.action, event=None))
        return [*actions, *sequence_check(policy, "train -> checkpoint at each save, train -> teardown at the end")]

    def run(self, ctx: RunContext) -> None:
        """Collective on the default group (the stop flag) and on every group the step handler uses."""
        policy = ctx.policy
        if policy.checkpoint.on_signal and agree_stop(ctx):
            log.warning("preemption signal before training: stopping without a checkpoint")
            return
        if policy.train.steps == 0:
            log.info("train.steps=0: no model, no training")
            return
        ctx.step_handler = self._build(ctx)
        with ctx.events.span("setup", handler=policy.train.kind):
            ctx.step_handler.setup(ctx)
        self._resume(ctx)
        self._loop(ctx, ctx.step_handler)

    def _build(self, ctx: RunContext) -> StepHandler:
        spec = registry.get("train", ctx.policy.train.kind)
        handler: StepHandler = spec.load()(ctx.policy.train.options)
        return handler

    def _resume(self, ctx: RunContext) -> None:
        from lifecycle.recovery.resume import resume_tiers

        if resume_tiers(ctx):
            after_resume(ctx)

    def _loop(self, ctx: RunContext, handler: StepHandler) -> None:
        from lifecycle.obs import progress

        total = ctx.policy.train.steps
        with progress.for_rank(ctx.rank, "train", total, start=ctx.step) as bar, \
                closing(self.loop.steps(ctx, total)) as steps:
            for step in steps:
                try:
                    metrics = handler.step(ctx, step)
                except BaseException as exc:  # noqa: BLE001 - the step span ends with this error, re-raised
                    steps.throw(exc)
                    raise
                self.loop.report(**metrics)
                bar.update(step, loss=metrics.get("loss"))


def after_resume(ctx: RunContext) -> None:
    """After a resume the adaptive deadlines continue from what the checkpoint saved (its first step is not a
    sample: caches are cold); without a saved state, or at another layout, the first step runs with the static one
    (:mod:`lifecycle.checkpoint.learned`)."""
    if ctx.progress.resumed_from is not None:
        from pathlib import Path

        from lifecycle.checkpoint import ckptdir, learned

        for model in ctx.deadlines.learned.values():
            model.after_resume()
        root = Path(ctx.policy.checkpoint.dir)
        if ctx.progress.resumed_tier == "memory":  # what was learned is saved with the commits: the newest one's
            tracker = ckptdir.read_tracker(root)
            if tracker.name is not None and tracker.error is None:
                learned.load(ctx, root / tracker.name)
            return
        learned.load(ctx, root / ckptdir.iter_name(ctx.progress.resumed_from))
