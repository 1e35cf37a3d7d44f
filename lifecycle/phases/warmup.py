"""Warmup: make every requested communicator connect now, with tiny real ops, before memory fills up."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lifecycle.distributed.messages import requested_groups
from lifecycle.phases.base import Action, GroupView, WarmTarget, barrier_actions, sequence_check
from lifecycle.phases.points import run_point
from lifecycle.policy.groupnames import GROUP_NAMES

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lifecycle.context import RunContext
    from lifecycle.distributed.collectives import WarmupOp
    from lifecycle.distributed.groups import ResolvedGroup
    from lifecycle.policy.schema import Policy

log = logging.getLogger(__name__)


def _job_actions(policy: Policy, targets: list[WarmTarget], deadline: float) -> dict[tuple[str, ...], list[Action]]:
    """Per warmed communicator, the job's messages on any of its names, at their size (largest first per op)."""
    from lifecycle.distributed.messages import job_messages

    out: dict[tuple[str, ...], list[Action]] = {}
    for t in targets:
        seen: set[str] = set()
        for m in sorted(job_messages(policy), key=lambda m: -m.nbytes):
            if m.group in t.names and m.op not in seen and (m.op != "p2p" or "pp" in t.names):
                seen.add(m.op)
                out.setdefault(t.names, []).append(Action(f"warm:{m.op}", t.names[0], deadline, f"{m.nbytes} B: "
                                                          f"{m.what}", t.names, t.ranks, nbytes=m.nbytes))
    return out


class ResolvedView:
    """The plan's GroupView over the groups this rank really has."""

    def __init__(self, groups: Sequence[ResolvedGroup]) -> None:
        self.groups = list(groups)

    def warm_targets(self, requested: Sequence[str]) -> list[WarmTarget]:
        targets = []
        for g in self.groups:
            names = tuple(n for n in g.names if n in requested)
            if names:
                targets.append(WarmTarget(names, tuple(g.ranks)))
        return sorted(targets, key=lambda t: GROUP_NAMES.index(t.names[0]))


def _op_for(ctx: RunContext, op: str, group: ResolvedGroup) -> WarmupOp:
    """The warmup op to run; ``p2p`` on the pipeline group goes to the real neighbouring stages."""
    from lifecycle.distributed import collectives

    if op != "p2p" or "pp" not in group.names:
        return collectives.OPS[op]
    interleaved = (ctx.policy.parallelism.vpp or 1) > 1

    def pipeline(pg: ProcessGroup, ranks: list[int], timeout_s: float, *, group_name: str) -> float:
        return collectives.pipeline_p2p(pg, ranks, timeout_s, group_name=group_name, interleaved=interleaved)

    return pipeline


def _sized(ctx: RunContext, op: str, nbytes: int) -> WarmupOp:
    from lifecycle.distributed import collectives

    return collectives.sized(op, nbytes, interleaved=(ctx.policy.parallelism.vpp or 1) > 1)


def _free_memory() -> int | None:
    """Free accelerator memory in bytes (CUDA only), else None."""
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    return None


def comm_memory_now() -> tuple[int, str] | None:
    """The memory communicators hold now, and how it is read: on CUDA the device memory in use that PyTorch's
    allocator does not hold (``total - free - memory_reserved``: NCCL's buffers, not the warm tensors, which the
    caching allocator keeps); elsewhere the resident memory of this process (gloo's pairs and buffers). None where
    neither can be read."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        free, total = torch.cuda.mem_get_info()
        return int(total - free - torch.cuda.memory_reserved()), "cuda"
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), "rss"
    except (OSError, ValueError, IndexError):
        return None


class CommMemory:
    """What warming each communicator cost this rank (the growth of :func:`comm_memory_now` across its warm ops,
    never negative), checked against ``distributed.comm_memory_budget_gib`` and ``memory_headroom_gib`` after every
    op: the group that pushes past either fails warmup at once, with its name, before the model takes its memory."""

    def __init__(self, budget_gib: float | None, headroom_gib: float) -> None:
        self.budget = None if budget_gib is None else budget_gib * 2**30
        self.headroom = headroom_gib * 2**30
        self.per_group: dict[str, int] = {}
        self.source: str | None = None

    @property
    def total(self) -> int:
        return sum(self.per_group.values())

    def add(self, label: str, before: tuple[int, str] | None, after: tuple[int, str] | None) -> None:
        if before is None or after is None:
            return
        self.source = after[1]
        self.per_group[label] = self.per_group.get(label, 0) + max(after[0] - before[0], 0)

    def check(self, group: ResolvedGroup, rank: int) -> None:
        from lifecycle.errors import PhaseError

        label = group.short
        if self.budget is not None and self.total > self.budget:
            raise PhaseError(f"warming group {label} took this rank's communicator memory to "
                             f"{self.total / 2**20:.1f} MiB ({label}: {self.per_group[group.label] / 2**20:.1f} MiB, "
                             f"measured as {self.source}), over distributed.comm_memory_budget_gib="
                             f"{self.budget / 2**30:g}; shrink it with distributed.nccl_env (NCCL_BUFFSIZE, "
                             f"NCCL_MAX_NCHANNELS, NCCL_PROTO), warmup.groups: used, or raise the budget",
                             phase="warmup", group=group.names[0], rank=rank)
        free = _free_memory() if self.headroom else None
        if free is not None and free < self.headroom:
            raise PhaseError(f"only {free / 2**30:.1f} GiB free on this GPU after warming group {label}; the policy "
                             f"asks for {self.headroom / 2**30:g} GiB headroom (distributed.memory_headroom_gib)",
                             phase="warmup", group=group.names[0], rank=rank)


class WarmupPhase:
    phase = "warmup"

    def enabled(self, ctx: RunContext) -> bool:
        return ctx.policy.warmup.enabled

    @staticmethod
    def plan(policy: Policy, view: GroupView | None = None) -> list[Action]:
        """Each (communicator, op) in the policy's order — executed as planned by :meth:`run`."""
        if not policy.warmup.enabled:
            return []
        dl = policy.warmup.deadline_s or policy.deadline("warmup")
        names = requested_groups(policy)
        targets = view.warm_targets(names) if view else [WarmTarget((n,)) for n in names]
        ops = policy.warmup.ops if "tiny" in policy.warmup.sizes else []
        sized = _job_actions(policy, targets, dl) if "job" in policy.warmup.sizes else {}

        def tiny(t: WarmTarget, op: str) -> Action:
            return Action(f"warm:{op}", t.names[0], dl, names=t.names, ranks=t.ranks)

        if policy.warmup.order == "group_major":
            actions = [a for t in targets for a in [*(tiny(t, op) for op in ops), *sized.get(t.names, [])]]
        else:
            actions = [*(tiny(t, op) for op in ops for t in targets), *(a for t in targets for a in sized.get(t.names,
                                                                                                              []))]
        return [*actions, *barrier_actions(policy, "after_warmup", policy.deadline("warmup")),
                *sequence_check(policy, "warmup -> train")]

    def run(self, ctx: RunContext) -> None:
        """Every rank runs the same ordered (group, op) list; each op is collective on its group."""
        from lifecycle.distributed import groups

        policy = ctx.policy
        names = requested_groups(policy, ctx.world_size, own_loop=ctx.own_loop)
        if policy.warmup.groups == "used" and ctx.own_loop and ctx.rank == 0:
            log.info("warmup.groups: used: a trainer's own loop does not say which groups it uses; warming every "
                     "group (the first step names any it used that warmup did not warm)")
        ctx.comms.groups = tuple(groups.resolve(ctx.parallel, names, policy.warmup.required))
        by_name = {n: g for g in ctx.comms.groups for n in g.names}
        plan = self.plan(policy, ResolvedView(ctx.comms.groups))
        point_index: dict[str, int] = {}
        timings: dict[str, float] = {}
        memory = CommMemory(policy.distributed.comm_memory_budget_gib, policy.distributed.memory_headroom_gib)
        for action in plan:
            if not action.op.startswith(("barrier:", "warm:")):
                continue  # the sequence check: the phase hook runs it when warmup is left
            if action.op.startswith("barrier:"):
                point = action.op.split(":", 1)[1]
                i = point_index.get(point, 0)
                point_index[point] = i + 1
                run_point(ctx, point, getattr(policy.barriers, point)[i], ctx.deadline("warmup"))
                continue
            op = action.op.split(":", 1)[1]
            group = by_name[action.names[0]]
            fn = _op_for(ctx, op, group) if not action.nbytes else _sized(ctx, op, action.nbytes)
            before = comm_memory_now()
            timings[group.label] = timings.get(group.label, 0.0) + self._op(ctx, fn, op, group,
                                                                            action.deadline_s or 0.0, action.nbytes)
            memory.add(group.label, before, comm_memory_now())
            if memory.source is not None:  # the timeline's counter: this rank's communicator memory as groups warm
                ctx.events.scalar("comm_memory_mib", round(memory.total / 2**20, 3), group=group.label)
            memory.check(group, ctx.rank)
        ctx.progress.warmup_s = timings
        self._record(ctx, memory)

    def _record(self, ctx: RunContext, memory: CommMemory) -> None:
        """One ``comm_memory`` event: per warmed group what it cost (measured) and what the model expected."""
        if memory.source is None:
            return
        from lifecycle.distributed.comm_memory import live_estimate

        estimate = live_estimate(ctx.policy, ctx.comms.groups)
        ctx.events.instant("comm_memory", source=memory.source, total_bytes=memory.total,
                           groups={g: {"measured_bytes": b, "estimate_bytes": estimate.get(g)}
                                   for g, b in memory.per_group.items()})

    def _op(self, ctx: RunContext, fn: WarmupOp, op: str, group: ResolvedGroup, deadline: float,
            nbytes: int = 0) -> float:
        if ctx.drills.fire("warmup", op=op, group=group.names[0]):
            return 0.0
        before = _free_memory()
        ranks = list(group.ranks) if group.size <= 256 else None  # keep events small at scale
        with ctx.events.span(f"warm:{op}", group=group.label, size=group.size, ranks=ranks,
                             bytes=nbytes or None) as extra:
            seconds = fn(group.pg, list(group.ranks), deadline, group_name=group.label)
            after = _free_memory()
            if before is not None:
                extra.update(mem_free_before=before, mem_free_after=after)
        ctx.ops.count(group.label)
        return float(seconds)
