"""What the control plane costs at a world size, before launch: sockets per rank, store calls, rank 0's reads.

Pure Python from the policy and the layout (``lifecycle explain --world-size N`` prints it without torch):

- sockets per rank, by whose groups open them: a gloo group connects a full mesh, one socket per other member, so
  a group over every rank costs ``world - 1`` on every rank. lifecycle's own: the memory tier's pair groups (two at
  most, :mod:`lifecycle.distributed.pairs`), ``checkpoint.coordination: gloo`` (a group over every rank), its store
  clients. torch's: the default group on gloo. megatron-core's: its gloo twins of the data-parallel groups. NCCL
  communicators are counted apart (their connections are NCCL's own);
- store calls per rank and watchdog poll (each rank's watchdog: publish, heartbeat, the alarm, two peers'
  heartbeats), rank 0's extra reads (the straggler view: every rank's record, every ``max(1, world / 64)`` s, up
  to ``FULL_VIEW_MAX`` ranks), and for the job the calls per second the store's one server answers, the
  connections it holds (every rank's store clients) and the bytes rank 0 reads per poll.

:func:`limits` holds the plan to the open-file limit the ranks will have and to a store budget; both name the key
that lowers what is over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lifecycle.distributed.comm_memory import GLOO_TWINS, backend_of
from lifecycle.distributed.layout import Layout
from lifecycle.distributed.pairs import sockets_per_rank
from lifecycle.errors import PolicyError, PolicyIssue
from lifecycle.jsontypes import JsonDict
from lifecycle.policy.groupnames import GROUP_NAMES
from lifecycle.policy.schema import Policy
from lifecycle.watchdog.core import FULL_VIEW_MAX, straggler_every_s

POLL_CALLS = 5
"""Store calls of one rank's healthy watchdog poll: ``set`` of its record, ``add`` of its heartbeat, ``check`` of the
alarm, ``add(key, 0)`` of its ring neighbour's and rank 0's heartbeats (lifecycle/watchdog/core.py ``_tick``)."""
RECORD_BYTES = 240
"""A progress record's JSON in the store, as a training rank publishes it (measured: 200-240 B at a step)."""
FDS_BEFORE_GROUPS = 64
"""Descriptors a rank holds besides its gloo sockets: its log, events, pipes, store connections (measured: 48
descriptors, 23 of them gloo sockets, on a synthetic rank of `lifecycle run` at world 4 with the memory tier; 64 leaves
room)."""
STORE_CALLS_PER_S = 46_000
"""What one TCPStore server (libuv) answered here with both cores issuing the watchdog's poll mix
(bench/scale.py capacity, bench/RESULTS.md "At scale"): the default of ``watchdog.store_budget_calls_per_s`` is a
quarter of it."""


@dataclass(frozen=True)
class Sockets:
    """Sockets one rank opens for one kind of group."""

    what: str
    owner: str
    count: int
    key: str
    """The policy key that governs it."""
    lower: str
    """The setting (or step) that lowers it."""


def sockets(policy: Policy, layout: Layout, rank: int, ranks_per_node: int) -> list[Sockets]:
    """The gloo sockets of ``rank``, by whose groups open them."""
    world = layout.world_size
    out: list[Sockets] = []
    memory = policy.checkpoint.memory
    if memory.every_steps and memory.replicate and world > 1:
        out.append(Sockets("memory tier pairs", "lifecycle", sockets_per_rank(world, ranks_per_node),
                           "checkpoint.memory.every_steps", "checkpoint.memory.every_steps=0"))
    if policy.checkpoint.coordination == "gloo" and policy.checkpoint.every_steps and world > 1:
        out.append(Sockets("checkpoint.coordination: gloo", "lifecycle", world - 1, "checkpoint.coordination",
                           "checkpoint.coordination=store"))
    if backend_of(policy) == "gloo" and world > 1:
        out.append(Sockets("default group (gloo)", "torch", world - 1, "distributed.backend",
                           "distributed.backend=nccl on GPUs, or fewer ranks a job"))
        # the layout's other groups are gloo groups too on this backend (each distinct rank set once: a lower bound,
        # megatron-core makes some twice); NCCL's communicators connect by NCCL's own means
        seen = {layout.group_of("world", rank)}
        mesh = 0
        for name in GROUP_NAMES:
            group = layout.group_of(name, rank)
            if group is not None and group not in seen and name not in GLOO_TWINS:
                seen.add(group)
                mesh += group.size - 1
        if mesh:
            out.append(Sockets("the layout's groups (gloo)", "the trainer", mesh, "distributed.backend",
                               "distributed.backend=nccl on GPUs, or smaller groups"))
    if policy.train.kind == "megatron_gpt":
        for name in GLOO_TWINS:
            group = layout.group_of(name, rank)
            if group is not None and group.size > 1:
                out.append(Sockets(f"megatron-core {name}", "megatron-core", group.size - 1, "train.kind",
                                   "megatron-core's create_gloo_process_groups=False (its groups, its setting)"))
    return out


def cost(policy: Policy, layout: Layout, rank: int, ranks_per_node: int) -> JsonDict:
    """Every figure ``explain`` prints (see the module)."""
    world = layout.world_size
    wd = policy.watchdog
    poll = wd.poll_interval_s
    view = wd.enabled and wd.straggler.action == "report" and 1 < world <= FULL_VIEW_MAX
    per_poll = POLL_CALLS if wd.enabled and world > 1 else 0
    view_every = max(1.0, straggler_every_s(world) / poll)  # polls between two reads of the view
    rank0_calls = per_poll + (3 / view_every if view else 0)  # started: check + get; the records: one multi_get
    rank0_bytes = (world * (RECORD_BYTES + 7) / view_every if view else 0) + 3 * 8  # records + started; beats
    server = (world * per_poll + (rank0_calls - per_poll)) / poll
    socks = sockets(policy, layout, rank, ranks_per_node)
    # torch's own (the default group's), the watchdog's two, the memory tier's writer
    clients = 1 + 2 * wd.enabled + bool(policy.checkpoint.memory.every_steps and world > 1)
    own = sum(s.count for s in socks if s.owner == "lifecycle")
    return {"rank": rank, "world_size": world, "ranks_per_node": ranks_per_node,
            "sockets": [vars(s) for s in socks], "lifecycle_sockets": own,
            "sockets_total": sum(s.count for s in socks),
            "store_clients": clients, "server_connections": clients * world,
            "store_calls_per_poll": per_poll, "rank0_store_calls_per_poll": round(rank0_calls, 2),
            "poll_interval_s": poll, "server_calls_per_s": round(server, 1),
            "rank0_bytes_per_poll": int(rank0_bytes), "rank0_full_view": view,
            "store_budget_calls_per_s": wd.store_budget_calls_per_s}


def open_file_limit() -> tuple[int | None, str]:
    """The soft ``RLIMIT_NOFILE`` of this process (what ranks started from it inherit), and where it was read."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None, "not readable here"
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (None if soft == resource.RLIM_INFINITY else int(soft)), "RLIMIT_NOFILE of this process, `ulimit -n`"


def limits(policy: Policy, layout: Layout, ranks_per_node: int, *, nofile: tuple[int | None, str] | None = None) \
        -> None:
    """The plan within the open-file limits and the store budget, else a PolicyError (exit 2) with every limit
    that is over,
    where it was read, the figure, and the key that lowers it. Rank 0's figures stand for every rank's (the groups
    of a layout repeat; rank 0 is in every group kind)."""
    figures = cost(policy, layout, 0, ranks_per_node)
    issues: list[PolicyIssue] = []
    limit, where = nofile if nofile is not None else open_file_limit()
    need = FDS_BEFORE_GROUPS + figures["sockets_total"]
    if limit is not None and need > limit:
        worst = max(figures["sockets"], key=lambda s: s["count"])
        shown = ", ".join(f"{s['what']} {s['count']}" for s in figures["sockets"])
        issues.append(PolicyIssue(
            worst["key"], f"at world size {layout.world_size} a rank would hold about {need} open files "
            f"({shown}, plus ~{FDS_BEFORE_GROUPS} of its own), over the open-file limit {limit} ({where}); the "
            f"largest is the {worst['what']} ({worst['owner']}'s): {worst['lower']}, or raise the limit "
            f"(`ulimit -n`, the scheduler's limits)", layout.world_size))
    conns = figures["server_connections"] + FDS_BEFORE_GROUPS
    if limit is not None and conns > limit:
        also = ", or drop the memory tier writer's client (checkpoint.memory.every_steps=0)" \
            if policy.checkpoint.memory.every_steps else ""
        issues.append(PolicyIssue(
            "watchdog.enabled", f"at world size {layout.world_size} the rendezvous store's server would hold "
            f"{figures['server_connections']} connections ({figures['store_clients']} a rank), over the open-file "
            f"limit {limit} ({where}; the launcher or torchrun's agent that hosts the store has it too): raise it on "
            f"the store's host (`ulimit -n`){also}", layout.world_size))
    budget = policy.watchdog.store_budget_calls_per_s
    if budget is not None and figures["server_calls_per_s"] > budget:
        poll = policy.watchdog.poll_interval_s
        needed = poll * figures["server_calls_per_s"] / budget
        issues.append(PolicyIssue(
            "watchdog.store_budget_calls_per_s", f"at world size {layout.world_size} the watchdogs would make the "
            f"store's one server answer {figures['server_calls_per_s']:.0f} calls/s "
            f"({figures['store_calls_per_poll']} a rank every watchdog.poll_interval_s={poll:g}s), over the budget; "
            f"raise watchdog.poll_interval_s to {math.ceil(needed * 10) / 10:g} or more, or the budget (measure "
            f"your store host with bench/scale.py)", budget))
    if issues:
        raise PolicyError(issues, source=f"world size {layout.world_size}")
