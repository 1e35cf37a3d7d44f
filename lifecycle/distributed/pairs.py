"""Pair groups: a gloo group of two ranks, made by its two members only.

A group over every rank connects a full mesh (one socket per peer on every member): at 1,024 ranks that is the usual
open-file limit of a process. What lifecycle exchanges rank to rank (the memory tier's copies with a buddy) needs only
the two ranks, so it rides on a group of those two, made with ``new_group(..., use_local_synchronization=True)``: the
other ranks take no part in making it, and each rank opens one socket per pair it is in, whatever the world size.

The pairs form rings (rank -> buddy -> buddy's buddy ...). Making a group waits for its other member; if every rank
made its own "forward" pair first, each would wait on a peer busy with its own forward pair, around the whole ring.
So the pairs are made in the order of a proper edge colouring of the ring (even edges, odd edges, and on a ring of odd
length the closing edge last): in each colour every rank waits only for a partner making the same pair, so the groups
form in at most three rounds at any world size.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def ring_shift(world: int, per_node: int) -> int:
    """How far a rank's buddy is: the same local rank on the next node (``per_node``), or the next rank on one
    node."""
    return per_node if world > per_node else 1


def colour(index: int, length: int) -> int:
    """The round of ring edge ``index`` (from position ``index`` to ``index + 1``) on a ring of ``length``
    positions: 0 or 1 by parity, 2 for the closing edge of a ring of odd length (it meets two even edges)."""
    return 2 if length % 2 and index == length - 1 else index % 2


def ring_pairs(rank: int, world: int, per_node: int) -> list[tuple[int, int]]:
    """The pairs ``rank`` is in — (rank, buddy) and (ward, rank), each as (low, high) — in the order every member
    makes them; one pair on a ring of two positions, none on a ring of one."""
    shift = ring_shift(world, per_node)
    length = world // shift
    if length < 2:
        return []
    position = rank // shift
    buddy, ward = (rank + shift) % world, (rank - shift) % world
    edges = {(colour(position, length), tuple(sorted((rank, buddy)))),
             (colour((position - 1) % length, length), tuple(sorted((ward, rank))))}
    if length == 2:  # buddy and ward are one rank: one pair
        edges = {min(edges)}
    return [(int(a), int(b)) for _, (a, b) in sorted(edges)]


def sockets_per_rank(world: int, per_node: int) -> int:
    """The sockets one rank opens for its pair groups (one per pair; flat in the world size)."""
    return len(ring_pairs(0, world, per_node))


def make_pairs(rank: int, world: int, per_node: int, timeout_s: float) -> dict[int, ProcessGroup]:
    """This rank's pair groups by the other member's rank. Only the members of each pair call into it (every rank
    calls this, at the same point of its run: its two partners must); each group waits at most ``timeout_s`` for
    the other member."""
    import torch.distributed as dist

    made: dict[int, ProcessGroup] = {}
    for low, high in ring_pairs(rank, world, per_node):
        group = dist.new_group([low, high], backend="gloo", timeout=datetime.timedelta(seconds=timeout_s),
                               use_local_synchronization=True, group_desc=f"lifecycle_pair_{low}_{high}")
        assert group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER
        made[high if low == rank else low] = group
    return made
