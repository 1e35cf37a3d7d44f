"""`lifecycle explain`: the plan, the group layout of one rank and where each value came from, without torch
or megatron.

Bounded for any world size up to :data:`~lifecycle.distributed.layout.MAX_WORLD_SIZE`: only the asked
rank's groups are computed (as :class:`~lifecycle.distributed.layout.RankSet`), the number of distinct
groups is counted without listing them, and a group of more than :data:`LISTED_RANKS` ranks is shown as a
range text (``large_groups``) rather than rank by rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from lifecycle.distributed.layout import MAX_WORLD_SIZE, Layout, RankSet
from lifecycle.distributed.ranks import fmt_ranks
from lifecycle.errors import PolicyError
from lifecycle.jsontypes import JsonDict
from lifecycle.machine.cost import cost
from lifecycle.machine.plan import Plan, WarmTarget, build_plan
from lifecycle.policy import installed
from lifecycle.policy.checks import world_issues
from lifecycle.policy.groupnames import GROUP_NAMES
from lifecycle.policy.load import Loaded, sha256
from lifecycle.policy.provenance import Origin, provenance
from lifecycle.policy.provenance import render as render_sources
from lifecycle.policy.timeouts import chain as timeout_chain

LISTED_RANKS = 65536
"""Groups up to this size are listed rank by rank in the layout (JSON ``groups``); larger ones as text."""
PLAN_RANKS = 256
"""A warmup action lists its group's ranks up to this size (as the runtime's warmup events do)."""


def listed(group: RankSet, limit: int = LISTED_RANKS) -> list[int] | None:
    """The group's ranks, or None when it has more than ``limit``."""
    return list(group) if group.size <= limit else None


class LayoutView:
    """Warm targets of one rank from the pure-Python layout (the same order the runtime uses)."""

    def __init__(self, layout: Layout, rank: int) -> None:
        self.layout = layout
        self.rank = rank

    def warm_targets(self, requested: Sequence[str]) -> list[WarmTarget]:
        by_group: dict[RankSet, list[str]] = {}
        for name in requested:
            group = self.layout.group_of(name, self.rank)
            if group is not None:
                by_group.setdefault(group, []).append(name)
        targets = [WarmTarget(tuple(names), tuple(listed(g, PLAN_RANKS) or ())) for g, names in by_group.items()]
        return sorted(targets, key=lambda t: GROUP_NAMES.index(t.names[0]))


def layout_for(loaded: Loaded, world_size: int) -> Layout:
    """The policy's layout at ``world_size``, after the world-size rules (a PolicyError naming the policy's file)."""
    from lifecycle.distributed.layout import of_policy

    issues = world_issues(loaded.policy, world_size)
    if issues:
        raise PolicyError(issues, source=loaded.source)
    return of_policy(loaded.policy, world_size)


def group_summary(layout: Layout, rank: int) -> JsonDict:
    """The rank's groups (listed, or as range text when large), absent kinds and counts: O(1) in the world."""
    groups: dict[str, RankSet] = {}
    for name in GROUP_NAMES:
        group = layout.group_of(name, rank)
        if group is not None:
            groups[name] = group
    return {
        "groups": {n: ranks for n, g in groups.items() if (ranks := listed(g)) is not None},
        "large_groups": {n: {"size": g.size, "ranks": g.fmt()} for n, g in groups.items() if g.size > LISTED_RANKS},
        "absent": [n for n in GROUP_NAMES if n not in groups],
        "communicators_per_rank": layout.communicators_of(rank),
        "distinct_groups": layout.count_distinct_groups(),
        "megatron_core": installed.version(installed.MEGATRON),
    }


def check_ranks(world_size: int | None, rank: int) -> None:
    """Range checks of ``--world-size`` and ``--rank``."""
    if world_size is None:
        if rank != 0:
            raise PolicyError.single("--rank", "needs --world-size (the rank of which world?); add "
                                     "--world-size N", rank)
        return
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise PolicyError.single("--world-size", f"must be from 1 to {MAX_WORLD_SIZE} (torch.distributed "
                                 "ranks are 32-bit ints)", world_size)
    if not 0 <= rank < world_size:
        raise PolicyError.single("--rank", f"must be in [0, {world_size}): ranks count from 0", rank)


def comm_memory(loaded: Loaded, layout: Layout, rank: int, ranks_per_node: int) -> JsonDict:
    """The estimated memory of this rank's communicators (:mod:`lifecycle.distributed.comm_memory`) for the backend
    the run will use (``distributed.backend=nccl`` asks for NCCL's on a CPU machine)."""
    from lifecycle.distributed.comm_memory import policy_bill

    return policy_bill(loaded.policy, layout, rank, ranks_per_node).as_dict()


def explain(loaded: Loaded, world_size: int | None, rank: int, ranks_per_node: int = 8) -> JsonDict:
    """Everything `explain` prints, as data (the --json output)."""
    check_ranks(world_size, rank)
    out: JsonDict = {"source": loaded.source, "sha256": sha256(loaded.policy),
                           "description": loaded.policy.description}
    view = None
    if world_size is not None:
        layout = layout_for(loaded, world_size)
        view = LayoutView(layout, rank)
        out.update(world_size=world_size, rank=rank, layout=group_summary(layout, rank),
                   comm_memory=comm_memory(loaded, layout, rank, ranks_per_node),
                   control_plane=cost(loaded.policy, layout, rank, ranks_per_node))
    plan: Plan = build_plan(loaded.policy, view)
    out["plan"] = plan.as_dict()
    out["sources"] = {k: o.as_dict() for k, o in provenance(loaded).items()}
    out["nccl_env"] = loaded.policy.distributed.effective_nccl_env()
    out["timeouts"] = [vars(link) for link in timeout_chain(loaded.policy)]
    return out


def render(info: JsonDict) -> str:
    """Human text of :func:`explain`'s data."""
    lines = [f"policy  {info['source']}", f"sha256  {info['sha256'][:16]}"]
    if info.get("description"):
        lines.append(f"about   {info['description']}")
    if info.get("sources"):
        lines += ["", *render_sources({k: Origin(**v) for k, v in info["sources"].items()})]
    if info.get("nccl_env"):
        lines += ["", "nccl env (every rank, before its first process group; NCCL reads it, gloo ignores it)",
                  "  " + " ".join(f"{k}={v}" for k, v in info["nccl_env"].items())]
    if "layout" in info:
        lay = info["layout"]
        lines += ["", f"layout  world size {info['world_size']}, rank {info['rank']}: "
                      f"{lay['distinct_groups']} distinct groups, {lay['communicators_per_rank']} "
                      f"communicators on this rank (as megatron-core "
                      f"{lay.get('megatron_core') or 'newest, not installed here,'} makes them)"]
        large = lay.get("large_groups", {})
        for name in GROUP_NAMES:
            if name in lay["groups"]:
                ranks = lay["groups"][name]
                lines.append(f"  {name:<15} [{fmt_ranks(ranks)}] ({len(ranks)} ranks)")
            elif name in large:
                lines.append(f"  {name:<15} [{large[name]['ranks']}] ({large[name]['size']} ranks)")
        if lay["absent"]:
            lines.append(f"  not in this layout: {', '.join(lay['absent'])}")
    if "comm_memory" in info:
        cm = info["comm_memory"]
        what = "NCCL estimate, device memory" if cm["backend"] == "nccl" else f"{cm['backend']} estimate, host memory"
        lines += ["", f"communicators ({what}, rank {cm['rank']}, {cm['ranks_per_node']} ranks per node): "
                      f"{cm['total_gib']:.3f} GiB in {len(cm['communicators'])} communicators"]
        for c in sorted(cm["communicators"], key=lambda c: -c["bytes"])[:8]:
            where = "intra-node" if c["intra_node"] else "inter-node"
            lines.append(f"  {c['group']:<15} {c['size']:>6} ranks  {where:<10}  {c['bytes'] / 2**20:9.1f} MiB")
        for d in cm["identical_rank_sets"]:
            lines.append(f"  same ranks, separate communicators: {', '.join(d['groups'])} ({d['size']} ranks): "
                         f"{d['bytes'] / 2**20:.1f} MiB more than one would cost")
        if cm.get("unused_by_job"):
            lines.append(f"  never used by the job's collectives: {', '.join(cm['unused_by_job'])}: "
                         f"{cm['unused_bytes'] / 2**20:.1f} MiB (warmup.groups: used does not create them)")
    if "control_plane" in info:
        lines += _control_lines(info["control_plane"])
    if info.get("timeouts"):
        lines += ["", "timeouts (every clock that bounds the job; validate refuses orderings that cannot work)"]
        for t in info["timeouts"]:
            secs = f"{t['seconds']:g}s" if t["seconds"] is not None else "-"
            lines.append(f"  {t['name']:<22} {secs:>8}  {t['source']}: {t['bounds']}")
    for phase, actions in info["plan"].items():
        lines += ["", f"{phase}" + ("  (nothing to do)" if not actions else "")]
        for i, a in enumerate(actions, 1):
            group = a.get("group", "-")
            also = [n for n in a.get("names", []) if n != group]
            alias = f" (= {', '.join(also)})" if also else ""
            dl = f"deadline {a['deadline_s']:g}s" if "deadline_s" in a else ""
            when = f" (when {a['when']})" if a.get("when") and a["op"] != "sequence_check" else ""
            lines.append(f"  {i:>2}. {a['op']:<32} {group + alias:<28} {dl:<16} {a.get('detail', '')}{when}".rstrip())
    return "\n".join(lines)


def _control_lines(cp: JsonDict) -> list[str]:
    """The control plane's figures (:mod:`lifecycle.machine.cost`)."""
    lines = ["", f"control plane (rank {cp['rank']} of {cp['world_size']}, {cp['ranks_per_node']} ranks per node)",
             f"  gloo sockets per rank: {cp['sockets_total']} ({cp['lifecycle_sockets']} of them lifecycle's own)"]
    for s in cp["sockets"]:
        lines.append(f"    {s['what']:<32} {s['count']:>6}  {s['owner']}'s; lowered by {s['lower']}")
    budget = cp["store_budget_calls_per_s"]
    over = f" (over the budget of {budget:g}: validate -w and run refuse it)" \
        if budget is not None and cp["server_calls_per_s"] > budget else ""
    lines += [f"  store clients per rank: {cp['store_clients']} (the store's server holds "
              f"{cp['server_connections']} connections); store calls per rank and poll: "
              f"{cp['store_calls_per_poll']} (rank 0: {cp['rank0_store_calls_per_poll']:g}), every "
              f"{cp['poll_interval_s']:g}s",
              f"  the store's server: {cp['server_calls_per_s']:g} calls/s for the job{over}",
              f"  rank 0 reads {cp['rank0_bytes_per_poll']} bytes per poll"
              + (" (every rank's record for the straggler view, spread over its period)" if cp["rank0_full_view"]
                 else "")]
    return lines
