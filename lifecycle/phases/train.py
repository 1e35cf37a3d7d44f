"""Train: build the step handler, resume, run the steps; barrier points, checkpoints and preemption
happen at step boundaries, in the same order on every rank."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lifecycle.handlers import registry
from lifecycle.phases.points import run_point

if TYPE_CHECKING:
    from lifecycle.context import RunContext
    from lifecycle.handlers.protocols import StepHandler

log = logging.getLogger(__name__)


class StopFlag:
    """The stop flag's max-reduce over the default group, issued now and read later: every rank must issue it
    at the same point and read it at the same point.

    One float says "a preemption signal arrived on some rank"; the same all-reduce carries each rank's proposals
    for the adaptive deadlines (``auto``): every rank then uses the maximum, with no collective of its own.
    Issued at one step boundary and read at the next, the all-reduce runs while the step computes instead of
    on the training thread's path (``checkpoint.signal_overlap``).
    """

    def __init__(self, ctx: RunContext, *, issued_at: int | None) -> None:
        import torch
        import torch.distributed as dist

        from lifecycle.distributed.collectives import device_for

        values = [1.0 if ctx.stop.preempt_signal else 0.0, *ctx.deadline_proposals()]
        self.issued_at = issued_at
        self.flag = torch.tensor(values, dtype=torch.float64, device=device_for())
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        ctx.op_counts["world"] += 1

    def read(self, ctx: RunContext, *, overlapped: bool) -> bool:
        """Wait (bounded by the train deadline) and apply the agreed deadlines; True: some rank was signalled."""
        from lifecycle.distributed.collectives import wait_works

        extra = {"overlapped": True, "issued_at": self.issued_at} if overlapped else {}
        with ctx.events.span("stop_flag", group="world", **extra):
            wait_works([self.work], "all_reduce(stop flag)", "world", list(range(ctx.world_size)),
                       ctx.deadline("train"), time.monotonic())
        agreed = self.flag.cpu().tolist()
        ctx.agree_deadlines(agreed[1:])
        return bool(agreed[0])


def agree_stop(ctx: RunContext) -> bool:
    """Issue the stop flag and read it at once (collective on the default group)."""
    return StopFlag(ctx, issued_at=ctx.step).read(ctx, overlapped=False)


class TrainPhase:
    phase = "train"

    def __init__(self, checkpoint: Callable[[RunContext, str], None]) -> None:
        self.checkpoint = checkpoint
        self.saved_at: int | None = None
        self.flag: StopFlag | None = None
        """The stop flag issued at the last step boundary, read at the next one (signal_overlap)."""

    def enabled(self, ctx: RunContext) -> bool:
        return True  # entered even with train.steps=0: the stop-flag agreement and teardown's order need it

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
        if ctx.resumed_from is not None:
            for model in ctx.adaptive.values():
                model.after_resume()  # the first step after a resume runs with the static deadline
        self._loop(ctx, ctx.step_handler)

    def _build(self, ctx: RunContext) -> StepHandler:
        spec = registry.get("train", ctx.policy.train.kind)
        handler: StepHandler = spec.load()(ctx.policy.train.options)
        return handler

    def _resume(self, ctx: RunContext) -> None:
        if ctx.policy.checkpoint.resume == "never":
            return
        from lifecycle.phases.checkpoint import resume

        resume(ctx)

    def _loop(self, ctx: RunContext, handler: StepHandler) -> None:
        from lifecycle.obs import progress

        policy = ctx.policy
        self.saved_at = ctx.step if ctx.resumed_from is not None else None
        with progress.for_rank(ctx.rank, "train", policy.train.steps, start=ctx.step) as bar:
            for step in range(ctx.step + 1, policy.train.steps + 1):
                ctx.events.step = step
                ctx.drills.fire("train", step=step)
                t0 = time.monotonic()
                with ctx.events.span("step") as extra:
                    slow = ctx.drills.slow_s(step)
                    if slow:
                        time.sleep(slow)  # a `slow` drill: extra compute on this rank (a straggler)
                    metrics = handler.step(ctx, step)
                    took = time.monotonic() - t0
                    compute = max(took - float(metrics.get("wait_s", 0.0)), 0.0)
                    extra.update(metrics, compute_s=round(compute, 6))
                ctx.observe("train", took)
                if ctx.compute is not None:
                    ctx.compute.add(compute)
                ctx.step = step
                bar.update(step, loss=metrics.get("loss"))
                if self._boundary(ctx, step):
                    return
        ctx.events.step = None
        if policy.checkpoint.at_end and self.saved_at != ctx.step:
            self.checkpoint(ctx, "end")

    def _boundary(self, ctx: RunContext, step: int) -> bool:
        """Everything that happens between two steps, in the same order on every rank. True: stop now."""
        ck, every = ctx.policy.checkpoint, ctx.policy.barriers.every_n_steps
        stop = False
        if self.flag is not None:  # issued at the last boundary, reduced while this step ran
            stop, self.flag = self.flag.read(ctx, overlapped=True), None
        if ctx.pending_save is not None:  # an async save overlapped this step: commit it now
            from lifecycle.phases.checkpoint import finish_pending

            finish_pending(ctx)
        if every is not None and step % every.n == 0:
            run_point(ctx, f"every_{every.n}_steps", every, ctx.deadline("train"))
        save_step = bool(ck.every_steps and step % ck.every_steps == 0)
        if save_step:
            self.checkpoint(ctx, "periodic")
            self.saved_at = step
        # The stop flag's all-reduce also carries the adaptive deadlines: with auto deadlines it runs even
        # when signals are not handled (its flag is then ignored).
        # checkpoint.signal_check_every trades that all-reduce on most steps for a later stop after a signal;
        # checkpoint.signal_overlap reads it one step later, except where the stop decides a save now (a
        # periodic-save step, the last step): there it is agreed at once, so a stop never saves twice.
        due = step % ck.signal_check_every == 0 or save_step
        if not stop and due and (ck.on_signal or ctx.adaptive):
            if ck.signal_overlap and not save_step and step < ctx.policy.train.steps:
                self.flag = StopFlag(ctx, issued_at=step)
            else:
                stop = agree_stop(ctx)
        if not (ck.on_signal and stop):
            return False
        ctx.stop.stop_step = step
        if self.saved_at != step:
            self.checkpoint(ctx, "preemption")
            self.saved_at = step
        log.warning("preempted at step %d, saved", step)
        if ctx.rank == 0:
            print(f"preempted at step {step}, saved", flush=True)
        return True
