"""Symbolic group names -> this rank's live communicators, de-duplicated and in a fixed order.

Megatron hands one communicator out under several names (the intra-instance expert-dp group *is* the
expert-dp group when there is one distributed-optimizer instance); a warmup that touched it once per
name would only waste time, so :func:`resolve` returns each communicator once, carrying every
requested name that maps to it. The order follows ``names.GROUP_NAMES`` and is therefore the same on
every rank: ranks in different groups of the same kind run the same sequence of collectives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lifecycle.errors import PhaseError, PolicyError
from lifecycle.policy.groupnames import ALL, GROUP_NAMES, closest

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lifecycle.distributed.parallel import ParallelState

logger = logging.getLogger(__name__)

# Kinds of which only some ranks are members (first/last pipeline stage): absence on a rank is
# normal as long as the parent kind exists, and is not a reason to fail a `required` check.
_PARTIAL = {"embd": "pp", "pos_embd": "pp"}


@dataclass(frozen=True)
class ResolvedGroup:
    """One communicator of this rank: the names it answers to, the ProcessGroup and its global ranks."""

    names: tuple[str, ...]
    pg: ProcessGroup
    ranks: list[int]

    @property
    def label(self) -> str:
        """The names joined with '=' (e.g. ``edp=intra_edp``), for logs and error messages."""
        return "=".join(self.names)

    @property
    def short(self) -> str:
        """The label with at most three names (``dp=dp_cp=tp_dp=...``), for messages."""
        return "=".join(self.names[:3]) + ("=..." if len(self.names) > 3 else "")

    @property
    def size(self) -> int:
        return len(self.ranks)


def _requested(names: Sequence[str] | str, required: Sequence[str]) -> list[str]:
    asked = list(GROUP_NAMES) if names == ALL else [names] if isinstance(names, str) else list(names)
    unknown = [n for n in [*asked, *required] if n not in GROUP_NAMES]
    if unknown:
        hints = {n: closest(n) for n in unknown}
        raise PolicyError.single("groups", f"unknown group name(s); did you mean {hints}? "
                                 f"Available names: {', '.join(GROUP_NAMES)}", unknown)
    wanted = set(asked) | set(required)
    return [n for n in GROUP_NAMES if n in wanted]


def group_ranks(parallel: ParallelState, name: str) -> tuple[ProcessGroup, list[int]] | None:
    """(ProcessGroup, global ranks) of this rank's group ``name``, or None if it has none. Local only."""
    import torch.distributed as dist

    pg = parallel.get_group(name)
    if pg is None:
        return None
    return pg, list(dist.get_process_group_ranks(pg))


def resolve(parallel: ParallelState, names: Sequence[str] | str,
            required: Sequence[str] = ()) -> list[ResolvedGroup]:
    """Look up the ProcessGroups behind ``names`` (or ``"all"``) on this rank.

    Local only, no collective. Names of ``required`` are resolved too; if one does not exist on this
    rank (and is not a kind this rank is legitimately outside of, like ``embd`` on a middle pipeline
    stage) a PhaseError names it. Other missing groups are skipped with a log line.
    """
    import torch.distributed as dist

    get_group = parallel.get_group
    order = _requested(names, required)
    found: dict[int, tuple[list[str], ProcessGroup]] = {}
    for name in order:
        pg = get_group(name)
        if pg is None:
            _missing(name, required, get_group, dist.get_rank())
            continue
        found.setdefault(id(pg), ([], pg))[0].append(name)
    out = [ResolvedGroup(tuple(n), pg, dist.get_process_group_ranks(pg)) for n, pg in found.values()]
    logger.debug("resolved groups: %s", ", ".join(f"{g.label}{g.ranks}" for g in out))
    return out


NEWER = {"tp_ep_pp_egtp": "megatron-core 0.19+"}
"""Groups that only newer megatron-cores make: their absence is the version's, not the layout's."""


def _missing(name: str, required: Sequence[str], get_group: Callable[[str], ProcessGroup | None],
             rank: int) -> None:
    parent = _PARTIAL.get(name)
    if parent is not None and get_group(parent) is not None:
        logger.info("group %r: this rank is not a member (normal on some pipeline stages); skipped", name)
        return
    if name in required:
        raise PhaseError(f"required group {name!r} does not exist on this rank; is megatron's "
                         f"parallel state initialized with a layout that creates it (e.g. "
                         f"inter_dist_opt needs dist_opt_instances > 1)?", group=name, rank=rank)
    if name in NEWER:
        logger.debug("group %r exists with %s only; skipped", name, NEWER[name])
        return
    logger.info("group %r does not exist in this layout; skipped", name)


def used_by(parallel: ParallelState, calls: dict[int, set[str]], pgs: dict[int, ProcessGroup],
            warmed: Sequence[ResolvedGroup]) -> tuple[dict[str, list[str]], list[str]]:
    """Name the communicators a traced block used (:mod:`lifecycle.distributed.tracing`): label -> methods, and the
    labels of those that warmup did not warm. A group lifecycle has no name for is labelled by its ranks. Local."""
    import torch.distributed as dist

    known = {id(g.pg): g.short for g in resolve_quietly(parallel)}
    warm = {id(g.pg) for g in warmed}
    used: dict[str, list[str]] = {}
    unwarmed = []
    for key, methods in calls.items():
        label = known.get(key) or f"ranks{dist.get_process_group_ranks(pgs[key])}"
        used[label] = sorted(methods)
        if key not in warm:
            unwarmed.append(label)
    return dict(sorted(used.items())), sorted(unwarmed)


def resolve_quietly(parallel: ParallelState) -> list[ResolvedGroup]:
    """Every group of this rank under all its names, without the log lines of :func:`resolve`. Local."""
    import torch.distributed as dist

    found: dict[int, tuple[list[str], ProcessGroup]] = {}
    for name in GROUP_NAMES:
        pg = parallel.get_group(name)
        if pg is not None:
            found.setdefault(id(pg), ([], pg))[0].append(name)
    return [ResolvedGroup(tuple(n), pg, dist.get_process_group_ranks(pg)) for n, pg in found.values()]
