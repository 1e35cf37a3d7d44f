"""Pair groups' order (lifecycle.distributed.pairs): every rank is in at most two pairs whatever the world, the pairs
are the buddy/ward rings of the memory tier, and the order the members make them in can never wait in a circle (each
colour class is a matching: a rank waits only for a partner making the same pair), checked by simulating the waits."""

from __future__ import annotations

import pytest

from lifecycle.distributed.pairs import ring_pairs, sockets_per_rank
from lifecycle.recovery.memory import buddy_of, ward_of

LAYOUTS = [(w, p) for w in (2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 64, 96, 1024) for p in (1, 2, 3, 4, 8) if w % p == 0]


@pytest.mark.parametrize(("world", "per_node"), LAYOUTS)
def test_pairs_are_the_buddy_rings_and_at_most_two_a_rank(world: int, per_node: int) -> None:
    for rank in range(world):
        pairs = ring_pairs(rank, world, per_node)
        partners = {b if a == rank else a for a, b in pairs}
        expected = {buddy_of(rank, world, per_node), ward_of(rank, world, per_node)} - {rank}
        assert partners == expected, (rank, pairs)
        assert len(pairs) <= 2 and all(a < b and rank in (a, b) for a, b in pairs)
    assert sockets_per_rank(world, per_node) <= 2


@pytest.mark.parametrize(("world", "per_node"), LAYOUTS)
def test_making_the_pairs_in_order_never_waits_in_a_circle(world: int, per_node: int) -> None:
    """Each rank makes its pairs in its order; a pair forms once both members have reached it. Every pair forms,
    in at most three rounds."""
    todo = {r: list(ring_pairs(r, world, per_node)) for r in range(world)}
    rounds = 0
    while any(todo.values()):
        heads = {r: t[0] for r, t in todo.items() if t}
        formed = {p for p in heads.values() if all(heads.get(m) == p for m in p)}
        assert formed, f"stuck: {heads}"  # a circle of waits
        for r in todo:
            if todo[r] and todo[r][0] in formed:
                todo[r].pop(0)
        rounds += 1
    assert rounds <= 3, rounds


def test_the_sockets_of_a_rank_do_not_grow_with_the_world() -> None:
    assert {sockets_per_rank(w, 8) for w in (24, 64, 1024, 16384)} == {2}
    assert sockets_per_rank(16, 8) == 1 and sockets_per_rank(8, 8) == 2 and sockets_per_rank(2, 1) == 1
