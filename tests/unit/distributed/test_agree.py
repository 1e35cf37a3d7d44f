"""Store agreements (lifecycle.distributed.agree) with threads as ranks on one real TCPStore: each answer equals what
a world collective would give, the same on every rank, generated over worlds and inputs; a missing rank is named;
each rank's calls stay flat in the world size; the keys of an agreement go once the next one is past."""

from __future__ import annotations

import datetime
import random
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
from torch.distributed import Store, TCPStore

from lifecycle.distributed.agree import Agreements
from lifecycle.errors import HangError
from lifecycle.recovery.memory import buddy_of, choose, ward_of

T = TypeVar("T")


@pytest.fixture(scope="module")
def server() -> Iterator[TCPStore]:
    store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30))
    yield store


class Counting:
    """A store client that counts its calls (the per-rank cost)."""

    def __init__(self, store: Store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Callable[..., object]:
        fn = getattr(self.store, name)

        def call(*args: object) -> object:
            self.calls += 1
            return fn(*args)
        return call


def _ranks(server: TCPStore, world: int, prefix: str, body: Callable[[Agreements], T],
           timeout_s: float = 20.0) -> tuple[list[T], list[int]]:
    """``body`` on ``world`` threads, each a rank with its own client; the answers and each rank's store calls."""
    out: list[T | None] = [None] * world
    calls = [0] * world
    errors: list[BaseException] = []

    # connected first, one after the other: a connection can wait seconds for the server's reverse lookup of the
    # client's address, which is not the agreement's cost
    clients = [Counting(TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30)))
               for _ in range(world)]

    def rank_main(rank: int) -> None:
        client = clients[rank]
        agree = Agreements(client, rank, list(range(world)), prefix)  # type: ignore[arg-type]
        try:
            out[rank] = body(agree)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        calls[rank] = client.calls

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return [o for o in out if o is not None] if all(o is not None for o in out) else out, calls  # type: ignore[return-value]


@pytest.mark.timeout(120)
def test_generated_agreements_equal_the_collectives_on_every_rank(server: TCPStore) -> None:
    rng = random.Random(54)
    for case in range(12):
        world = rng.choice([2, 3, 4, 5, 8, 16])
        flags = [rng.random() > 0.15 for _ in range(world)]
        values = [rng.randrange(0, 5) for _ in range(world)]
        owns = [set(rng.sample(range(1, 12), rng.randrange(0, 4))) for _ in range(world)]
        floor = rng.randrange(0, 6)

        def body(a: Agreements, flags: list[bool] = flags, values: list[int] = values,
                 owns: list[set[int]] = owns, floor: int = floor) -> tuple[bool, int, int | None, object]:
            ok = a.all_true("flag", flags[a.rank], 10.0)
            big = a.largest("max", values[a.rank], 10.0)
            best = a.newest_common("steps", {s for s in owns[a.rank] if s >= max(floor, 1)}, 10.0)
            given = a.from_rank("lineage", 0, [7, [3, 4]] if a.rank == 0 else None, 10.0)
            return ok, big, best, given

        answers, _ = _ranks(server, world, f"gen/{case}", body)
        expected = (all(flags), max(values), choose(owns, owns, None, floor), [7, [3, 4]])
        assert all(tuple(a) == expected for a in answers), (case, answers, expected)


@pytest.mark.timeout(120)
def test_the_restore_step_from_each_rank_s_and_its_buddy_s_holdings_is_choose_s(server: TCPStore) -> None:
    """What MemoryTier.restore agrees on — each rank offers its own steps and those its buddy holds for it (learned
    over their pair) — equals ``choose`` with every rank's holdings in view, with buddies on other nodes."""
    rng = random.Random(5454)
    for case in range(8):
        per_node, nodes = rng.choice([(1, 4), (2, 2), (2, 3), (4, 2), (1, 5)])
        world = per_node * nodes
        owns = [set(rng.sample(range(1, 9), rng.randrange(0, 4))) for _ in range(world)]
        helds = [set(rng.sample(range(1, 9), rng.randrange(0, 4))) for _ in range(world)]  # held for ward_of(r)
        tracked = rng.randrange(0, 5)

        def body(a: Agreements, owns: list[set[int]] = owns, helds: list[set[int]] = helds, tracked: int = tracked,
                 per_node: int = per_node, world: int = world) -> int | None:
            held_for_me = helds[buddy_of(a.rank, world, per_node)]
            assert ward_of(buddy_of(a.rank, world, per_node), world, per_node) == a.rank
            mine = {s for s in owns[a.rank] | held_for_me if s >= max(tracked, 1)}
            return a.newest_common("memory copies", mine, 10.0)

        answers, _ = _ranks(server, world, f"restore/{case}", body)
        expected = choose(owns, helds, per_node, tracked)
        assert answers == [expected] * world or (expected is None and answers == [None] * world), \
            (case, answers, expected)


@pytest.mark.timeout(120)
def test_a_rank_s_store_calls_do_not_grow_with_the_world(server: TCPStore) -> None:
    def body(a: Agreements) -> int:
        for i in range(3):
            a.all_true(f"f{i}", True, 10.0)
            a.largest(f"m{i}", 5, 10.0)
            a.newest_common(f"s{i}", {4, 6, 8}, 10.0)
        return 0

    per_world = {}
    for world in (2, 8, 32):
        _, calls = _ranks(server, world, f"flat/{world}", body, timeout_s=60.0)
        per_world[world] = max(calls)
    # a rank's role in a barrier (the last to arrive settles it, the last to leave deletes its 4 keys) moves its count
    # by a few calls; nothing moves it with the world size
    assert max(per_world.values()) - min(per_world.values()) <= 4 * 9, per_world


def test_a_rank_that_never_comes_is_named(server: TCPStore) -> None:
    client = TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))
    agree = Agreements(client, 0, [0, 1, 2], "absent", phase="checkpoint", group="memory")
    with pytest.raises(HangError, match=r"on group 'memory' timed out after 0\.3s: ranks \[1, 2\] did not arrive"):
        agree.all_true("copies written", True, 0.3)


@pytest.mark.timeout(60)
def test_an_agreement_s_keys_go_once_the_next_one_is_past(server: TCPStore) -> None:
    def body(a: Agreements) -> int:
        a.all_true("one", True, 10.0)
        a.all_true("two", True, 10.0)
        return 0

    _ranks(server, 3, "keys", body)
    probe = TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))
    assert not probe.check(["lifecycle/agree:keys/1:one/bad"])  # deleted after the second barrier
    assert probe.check(["lifecycle/agree:keys/2:two/bad"])  # the last one's stays (nobody is past it yet)


@pytest.mark.timeout(60)
def test_alike_names_the_odd_group_and_reads_payloads_only_there(server: TCPStore) -> None:
    # two groups of two ranks: {0, 1} alike, {2, 3} not
    tokens = {0: b"a", 1: b"a", 2: b"b", 3: b"c"}

    def body(a: Agreements) -> dict[str, dict[int, bytes]]:
        ranks = [0, 1] if a.rank < 2 else [2, 3]
        return a.alike("digests", [("dp", ranks, tokens[a.rank])], b"payload%d" % a.rank, 10.0)

    answers, _ = _ranks(server, 4, "alike", body)
    assert answers[0] == answers[1] == {}
    assert answers[2] == answers[3] == {"dp": {2: b"payload2", 3: b"payload3"}}
