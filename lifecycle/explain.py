"""`lifecycle explain`: the plan, the group layout of one rank and where each value came from, without torch
or megatron."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lifecycle.distributed.names import GROUP_NAMES
from lifecycle.errors import PolicyError
from lifecycle.machine.plan import Plan, WarmTarget, build_plan
from lifecycle.policy.checks import world_issues
from lifecycle.policy.load import Loaded, sha256
from lifecycle.policy.provenance import Origin, provenance
from lifecycle.policy.provenance import render as render_sources
from lifecycle.ranks import fmt_ranks


class LayoutView:
    """Warm targets of one rank from the pure-Python layout (the same order the runtime uses)."""

    def __init__(self, layout: Any, rank: int) -> None:
        self.layout = layout
        self.rank = rank

    def warm_targets(self, requested: Sequence[str]) -> list[WarmTarget]:
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for name in requested:
            ranks = self.layout.ranks_of(name, self.rank)
            if ranks:
                by_ranks.setdefault(tuple(ranks), []).append(name)
        targets = [WarmTarget(tuple(names), ranks) for ranks, names in by_ranks.items()]
        return sorted(targets, key=lambda t: GROUP_NAMES.index(t.names[0]))


def _layout(loaded: Loaded, world_size: int) -> Any:
    from lifecycle.distributed.layout import build_layout

    issues = world_issues(loaded.policy, world_size)
    if issues:
        raise PolicyError(issues, source=loaded.source)
    par = loaded.policy.parallelism
    return build_layout(world_size, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, etp=par.etp,
                        dist_opt_instances=par.dist_opt_instances, order=par.order)


def group_summary(layout: Any, rank: int) -> dict[str, Any]:
    groups = {n: layout.ranks_of(n, rank) for n in GROUP_NAMES}
    distinct = {tuple(r) for r in groups.values() if r}
    world_distinct: set[tuple[int, ...]] = set()
    for name in GROUP_NAMES:
        world_distinct.update(tuple(g) for g in layout.groups(name))
    return {
        "groups": {n: r for n, r in groups.items() if r},
        "absent": [n for n, r in groups.items() if not r],
        "communicators_per_rank": len(distinct),
        "distinct_groups": len(world_distinct),
    }


def explain(loaded: Loaded, world_size: int | None, rank: int) -> dict[str, Any]:
    """Everything `explain` prints, as data (the --json output)."""
    out: dict[str, Any] = {"source": loaded.source, "sha256": sha256(loaded.policy),
                           "description": loaded.policy.description}
    view = None
    if world_size is not None:
        if not 0 <= rank < world_size:
            raise PolicyError.single("--rank", f"must be in [0, {world_size})", rank)
        layout = _layout(loaded, world_size)
        view = LayoutView(layout, rank)
        out.update(world_size=world_size, rank=rank, layout=group_summary(layout, rank))
    plan: Plan = build_plan(loaded.policy, view)
    out["plan"] = plan.as_dict()
    out["sources"] = {k: o.as_dict() for k, o in provenance(loaded).items()}
    return out


def render(info: dict[str, Any]) -> str:
    """Human text of :func:`explain`'s data."""
    lines = [f"policy  {info['source']}", f"sha256  {info['sha256'][:16]}"]
    if info.get("description"):
        lines.append(f"about   {info['description']}")
    if info.get("sources"):
        lines += ["", *render_sources({k: Origin(**v) for k, v in info["sources"].items()})]
    if "layout" in info:
        lay = info["layout"]
        lines += ["", f"layout  world size {info['world_size']}, rank {info['rank']}: "
                      f"{lay['distinct_groups']} distinct groups, {lay['communicators_per_rank']} "
                      f"communicators on this rank"]
        for name, ranks in lay["groups"].items():
            lines.append(f"  {name:<15} [{fmt_ranks(ranks)}] ({len(ranks)} ranks)")
        if lay["absent"]:
            lines.append(f"  not in this layout: {', '.join(lay['absent'])}")
    for phase, actions in info["plan"].items():
        lines += ["", f"{phase}" + ("  (nothing to do)" if not actions else "")]
        for i, a in enumerate(actions, 1):
            group = a.get("group", "-")
            also = [n for n in a.get("names", []) if n != group]
            alias = f" (= {', '.join(also)})" if also else ""
            dl = f"deadline {a['deadline_s']:g}s" if "deadline_s" in a else ""
            lines.append(f"  {i:>2}. {a['op']:<26} {group + alias:<28} {dl:<16} {a.get('detail', '')}".rstrip())
    return "\n".join(lines)
