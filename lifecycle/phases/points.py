"""Named barrier points of the policy (after_init, after_warmup, before/after_checkpoint, before_teardown,
every_n_steps), executed on their group with their timeout."""

from __future__ import annotations

import logging
from typing import Any

from lifecycle.errors import PhaseError
from lifecycle.phases.base import RunContext

log = logging.getLogger(__name__)


def group_ranks(name: str) -> tuple[Any, list[int]] | None:
    """(ProcessGroup, global ranks) of this rank's group ``name``, or None if it has none. Local only."""
    import torch.distributed as dist

    from lifecycle.backends.megatron.parallel import get_group

    pg = get_group(name)
    if pg is None:
        return None
    return pg, list(dist.get_process_group_ranks(pg))


def run_point(ctx: RunContext, point: str, barrier: Any, default_timeout: float) -> None:
    """Run one barrier point. Every rank of ``barrier.group`` must call it, in plan order.

    ``via: store`` meets on the TCPStore (a timeout names the late ranks, process groups stay usable);
    ``via: collective`` is a process-group barrier bounded by the same timeout.
    """
    from lifecycle.dist import collectives
    from lifecycle.dist.barrier import store_barrier

    timeout = barrier.timeout_s or default_timeout
    phase = ctx.events.phase
    found = group_ranks(barrier.group)
    # Every rank takes a key, member or not, so later keys stay identical across ranks.
    key = ctx.next_key(f"barrier/{point}/{barrier.group}")
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
            store_barrier(ctx.store, f"{key}/{min(ranks)}", ctx.rank, ranks, timeout, phase=phase,
                          group=barrier.group)
        else:
            collectives.barrier(pg, ranks, timeout, group_name=barrier.group)
            ctx.op_counts[barrier.group] += 1


def run_points(ctx: RunContext, point: str, default_timeout: float) -> None:
    """Every barrier listed under ``barriers.<point>``, in order."""
    for barrier in getattr(ctx.policy.barriers, point):
        run_point(ctx, point, barrier, default_timeout)
