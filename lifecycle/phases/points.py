"""Named barrier points of the policy (after_init, after_warmup, before/after_checkpoint, before_teardown,
every_n_steps), executed on their group with their timeout."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lifecycle.distributed.groups import group_ranks
from lifecycle.errors import PhaseError

if TYPE_CHECKING:
    from lifecycle.context import RunContext
    from lifecycle.policy.sections import BarrierPoint

log = logging.getLogger(__name__)


def run_point(ctx: RunContext, point: str, barrier: BarrierPoint, default_timeout: float) -> None:
    """Run one barrier point. Every rank of ``barrier.group`` must call it, in plan order.

    ``via: store`` meets on the TCPStore (a timeout names the late ranks, process groups stay usable);
    ``via: collective`` is a process-group barrier bounded by the same timeout.
    """
    from lifecycle.distributed import collectives
    from lifecycle.distributed.barrier import store_barrier

    timeout = barrier.timeout_s or default_timeout
    phase = ctx.events.phase
    found = group_ranks(ctx.parallel, barrier.group)
    # Every rank takes a key, member or not, so later keys stay identical across ranks.
    key = ctx.ops.next_key(f"barrier/{point}/{barrier.group}")
    if found is None:
        if barrier.if_missing == "error":
            raise PhaseError(f"barrier point '{point}': group '{barrier.group}' does not exist in this "
                             f"layout; set if_missing: skip or change the group", phase=phase, rank=ctx.rank,
                             group=barrier.group)
        log.info("barrier point %s: no group %s here, skipped", point, barrier.group)
        return
    pg, ranks = found
    if ctx.drills.fire(phase, step=ctx.step or None, op="barrier", group=barrier.group):
        return
    with ctx.events.span(f"barrier:{point}", group=barrier.group, via=barrier.via, size=len(ranks),
                         ranks=ranks if len(ranks) <= 256 else None):
        if barrier.via == "store":
            store_barrier(ctx.require_store(), f"{key}/{min(ranks)}", ctx.rank, ranks, timeout, phase=phase,
                          group=barrier.group)
        else:
            collectives.barrier(pg, ranks, timeout, group_name=barrier.group)
            ctx.ops.count(barrier.group)


def run_points(ctx: RunContext, point: str, default_timeout: float) -> None:
    """Every barrier listed under ``barriers.<point>``, in order."""
    points: list[BarrierPoint] = getattr(ctx.policy.barriers, point)
    for barrier in points:
        run_point(ctx, point, barrier, default_timeout)
