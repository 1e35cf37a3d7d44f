"""Teardown: leave in an agreed order on success, abort without waiting on failure, never hang.

A hard deadline (``teardown.deadline_s``) is armed at entry: when it passes, the step that hung is
logged and the process leaves with ``os._exit(exit_codes.teardown_deadline)``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from lifecycle.phases.base import Action, GroupView, barrier_actions
from lifecycle.phases.points import run_points

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lifecycle.context import RunContext
    from lifecycle.policy.schema import Policy

log = logging.getLogger(__name__)


class HardDeadline:
    """A daemon timer that force-exits the process if teardown overruns. ``cancel()`` is idempotent."""

    def __init__(self, seconds: float, code: int, on_expire: Callable[[str], None] | None = None) -> None:
        self.step = "start"
        self.code = code
        self.on_expire = on_expire
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._seconds = seconds

    def start(self) -> HardDeadline:
        self._timer.start()
        return self

    def _expire(self) -> None:
        msg = (f"teardown hit its hard deadline of {self._seconds:g}s while in step '{self.step}'; "
               f"exiting with code {self.code}")
        log.error(msg)
        print(f"[rank {os.environ.get('RANK', '?')}] {msg}", file=sys.stderr, flush=True)
        if self.on_expire is not None:
            try:
                self.on_expire(self.step)
            except Exception:  # noqa: BLE001 - we are leaving anyway
                pass
        os._exit(self.code)

    def cancel(self) -> None:
        self._timer.cancel()


FAILURE_STEP_S = 3.0
"""Seconds each abort/destroy call of the failure path may take before it is given up."""


def bounded(fn: Callable[[], None], seconds: float, name: str) -> bool:
    """Run ``fn`` on a daemon helper thread; True when it returned within ``seconds`` (its errors are logged)."""
    def run() -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the process is leaving; say what failed
            log.debug("teardown %s: %s", name, exc)

    helper = threading.Thread(target=run, name=f"lifecycle-{name}", daemon=True)
    helper.start()
    helper.join(seconds)
    return not helper.is_alive()


def _subgroups_newest_first() -> list[ProcessGroup]:
    """Every non-default process group, in reverse creation order (c10d keeps them in creation order)."""
    import torch.distributed.distributed_c10d as c10d

    default = c10d._get_default_group() if c10d.is_initialized() else None
    groups = [pg for pg in list(c10d._world.pg_map) if pg is not default]
    return groups[::-1]


class TeardownPhase:
    phase = "teardown"

    def __init__(self) -> None:
        self.deadline: HardDeadline | None = None

    def enabled(self, ctx: RunContext) -> bool:
        return True

    @staticmethod
    def plan(policy: Policy, view: GroupView | None = None) -> list[Action]:
        dl = policy.deadline("teardown")
        actions = []
        for step in policy.teardown.success:
            actions.append(Action(f"teardown:{step}", "world" if step in ("barrier", "destroy_process_group")
                                  else None, dl))
            if step == "barrier":
                actions.extend(barrier_actions(policy, "before_teardown", dl))
        restart = policy.restart
        if restart.mode == "in_process" and restart.max_restarts:
            actions.append(Action("restart_in_place", None, restart.in_process_deadline_s,
                                  f"instead of the failure path, up to {restart.max_restarts} times: cut the groups' "
                                  f"connections, destroy, agree on the store, then init again in this process",
                                  when="an exception or a divergence in warmup, train or checkpoint", event=None))
        actions.append(Action("hard_deadline", None, policy.teardown.deadline_s,
                              f"os._exit({policy.teardown.exit_codes.teardown_deadline}) when passed; "
                              f"failure path: {policy.teardown.failure}", event=None))
        return actions

    def arm(self, ctx: RunContext, *, step: str = "start") -> HardDeadline:
        """Start the hard exit timer (``teardown.deadline_s``); ``cancel()`` it when teardown returned."""
        td = ctx.policy.teardown
        deadline: HardDeadline

        def note(step: str) -> None:
            from lifecycle.rundir.elastic import record_failure

            ctx.events.instant("teardown_deadline", step_name=step, exit_code=deadline.code)
            ctx.events.close()
            record_failure(rank=ctx.rank, error="TeardownDeadline", exit_code=deadline.code, phase="teardown",
                           message=f"teardown hit its hard deadline of {td.deadline_s:g}s in step '{step}'")

        deadline = HardDeadline(td.deadline_s, td.exit_codes.teardown_deadline, note)
        deadline.step = step
        self.deadline = deadline.start()
        return deadline

    def _mark(self, step: str) -> None:
        if self.deadline is not None:
            self.deadline.step = step

    def run(self, ctx: RunContext) -> None:
        """Success path in the policy's order. ``barrier`` and ``destroy_*`` involve every rank."""
        _close_memory(ctx, finished=True)
        for step in ctx.policy.teardown.success:
            self._mark(step)
            ctx.drills.fire("teardown", op=step)
            with ctx.events.span(f"teardown:{step}"):
                getattr(self, f"_{step}")(ctx)

    def run_failure(self, ctx: RunContext, error: BaseException | None) -> None:
        """No barrier, no waiting on peers: finish local work, abort or destroy, leave.

        Each call that can block on a dead peer (a gloo group whose collective timed out joins its worker
        threads on destroy) runs on a helper thread and is given up after a few seconds: the process is leaving.
        """
        self._mark("failure")
        ctx.drills.fire("teardown", op="failure")
        with ctx.events.span("teardown:failure", error=type(error).__name__ if error else None):
            _close_memory(ctx, finished=False)
            self.release(ctx)

    def release(self, ctx: RunContext) -> list[str]:
        """The step handler, then the process groups in the policy's failure order (``teardown.failure``): each step
        on a helper thread, given up after a few seconds. The steps given up (an in-process restart cannot build
        on groups that did not go)."""
        budget = min(FAILURE_STEP_S, ctx.deadline("teardown"))
        self._release_step_handler(ctx)
        skipped = []
        steps = ["destroy_model_parallel", *(["abort"] if ctx.policy.teardown.failure == "abort" else []),
                 "destroy_process_group"]
        for step in steps:
            self._mark(f"failure:{step}")
            if not bounded(partial(getattr(self, f"_{step}"), ctx), budget, step):
                skipped.append(step)
                ctx.events.instant("teardown_skipped", step_name=step, after_s=budget)
                log.warning("teardown: %s did not return within %gs; leaving without it", step, budget)
        return skipped

    def _barrier(self, ctx: RunContext) -> None:
        run_points(ctx, "before_teardown", ctx.deadline("teardown"))

    def _finalize_async(self, ctx: RunContext) -> None:
        if ctx.progress.pending_save is not None:
            from lifecycle.phases.checkpoint import finish_pending

            finish_pending(ctx)
        self._release_step_handler(ctx)

    def _release_step_handler(self, ctx: RunContext) -> None:
        if ctx.step_handler is not None:
            handler, ctx.step_handler = ctx.step_handler, None
            handler.close()

    def _destroy_model_parallel(self, ctx: RunContext) -> None:
        if ctx.comms.adopted_groups:
            log.info("teardown: the model-parallel groups are the trainer's: left to it")
            return
        ctx.parallel.destroy()

    def _destroy_subgroups(self, ctx: RunContext) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        for pg in _subgroups_newest_first() if not ctx.comms.adopted_world else _own_groups(ctx):
            dist.destroy_process_group(pg)

    def _abort(self, ctx: RunContext) -> None:
        import torch.distributed.distributed_c10d as c10d

        if not c10d.is_initialized() or ctx.comms.adopted_world:  # the trainer's communicators are not lifecycle's
            return
        abort = getattr(c10d, "_abort_process_group", None)
        if abort is None:
            return
        try:
            abort()  # aborts every group's communicators (NCCL); a no-op-ish call on gloo
        except Exception as exc:  # noqa: BLE001 - not every backend supports abort
            log.debug("abort not supported here: %s", exc)

    def _destroy_process_group(self, ctx: RunContext) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        if ctx.comms.adopted_world:  # only what lifecycle made; the trainer destroys its own groups itself
            for pg in _own_groups(ctx):
                dist.destroy_process_group(pg)
            log.info("teardown: the default process group is the trainer's: left to it")
            return
        dist.destroy_process_group()


def _own_groups(ctx: RunContext) -> list[ProcessGroup]:
    """The process groups lifecycle made in a trainer's process (the checkpoint coordination group, the memory
    tier's)."""
    groups, ctx.comms.ckpt_group = [ctx.comms.ckpt_group], None
    tier = ctx.comms.memory
    if tier is not None:
        groups += tier.release_groups()
    return [g for g in groups if g is not None]


def _close_memory(ctx: RunContext, *, finished: bool) -> None:
    """The memory tier's copy in flight and its copies: waited for and removed on a finished run; on a failure
    left for the next attempt (a copy still in flight is given a second at most: the process is leaving)."""
    tier = ctx.comms.memory
    if tier is None:
        return
    try:
        tier.close(ctx, finished=finished, wait_s=None if finished else 1.0)
    except Exception as exc:  # noqa: BLE001 - leaving either way; the copies are checked at the next start
        log.warning("memory tier: %s", exc)
