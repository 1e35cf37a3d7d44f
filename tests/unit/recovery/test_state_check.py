"""The replica check's parts (lifecycle.recovery.state_check): the per-tensor digests (bit-exact replicas agree, any
flipped bit is seen, pieces give the same digest as one pass) and the choice of the ranks that differ, against
generated replica groups. The check on real gloo ranks: tests/distributed/test_memory_tier.py."""

from __future__ import annotations

import random

import pytest
import torch

from lifecycle.recovery import state_check
from lifecycle.recovery.state_check import digests, disagreement

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool)


def _tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    shape = [rng.randint(1, 7) for _ in range(rng.randint(1, 3))]
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


@pytest.mark.parametrize("seed", range(4))
def test_equal_tensors_agree_and_any_single_flipped_bit_is_seen(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(150):
        named = [(f"t{i}", _tensor(rng)) for i in range(rng.randint(1, 4))]
        copy = [(n, t.clone()) for n, t in named]
        assert torch.equal(digests(named), digests(copy))
        k = rng.randrange(len(copy))
        raw = copy[k][1].view(-1).view(torch.uint8)
        at, bit = rng.randrange(raw.numel()), rng.randrange(8)
        if copy[k][1].dtype == torch.bool:
            raw[at] ^= 1  # a bool holds 0 or 1
        else:
            raw[at] ^= 1 << bit
        mine, theirs = digests(named), digests(copy)
        assert not torch.equal(mine[k], theirs[k]), (copy[k][1].dtype, at, bit)
        assert all(torch.equal(mine[j], theirs[j]) for j in range(len(named)) if j != k)


def test_signed_zeros_differ_and_no_tensors_is_an_empty_table() -> None:
    assert not torch.equal(digests([("z", torch.tensor([0.0]))]), digests([("z", torch.tensor([-0.0]))]))
    assert digests([]).shape == (0, 2)


def test_a_tensor_taken_in_pieces_has_the_digest_of_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.randn(1001, 3)
    whole = digests([("w", t)])
    monkeypatch.setattr(state_check, "_CHUNK", 64)
    assert torch.equal(digests([("w", t)]), whole)



def _one_by_one(named: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """The digests' definition, one tensor at a time in Python integers: the sums of its 32-bit words (bytes when
    its size is not a multiple of 4) and of their squares, wrapped to signed 64 bits."""
    def wrap(v: int) -> int:
        v &= (1 << 64) - 1
        return v - (1 << 64) if v >= 1 << 63 else v

    rows = []
    for _, t in named:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        words = (raw.view(torch.int32) if raw.numel() % 4 == 0 else raw).tolist()
        rows.append([wrap(sum(words)), wrap(sum(w * w for w in words))])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


@pytest.mark.parametrize("chunk", [1 << 22, 16, 5])
def test_batched_digests_are_the_per_tensor_sums_whatever_the_batch_bounds(monkeypatch: pytest.MonkeyPatch,
                                                                            chunk: int) -> None:
    """Small tensors are summed in batches (running sums over one concatenation), large ones in pieces: the same
    rows as the definition, for generated mixes of dtypes (word and byte views), sizes (empty, below and above the
    batch bound) and huge words (the square sums wrap)."""
    monkeypatch.setattr(state_check, "_CHUNK", chunk)
    rng = random.Random(chunk)
    for _ in range(60):
        named = [(f"t{i}", _tensor(rng)) for i in range(rng.randint(0, 9))]
        if rng.random() < 0.3:
            named.insert(rng.randint(0, len(named)), ("empty", torch.zeros(0)))
        if rng.random() < 0.3:
            named.insert(rng.randint(0, len(named)), ("big", torch.full((7,), -2**31, dtype=torch.int32)))
        assert torch.equal(digests(named), _one_by_one(named)), [(t.dtype, t.numel()) for _, t in named]

@pytest.mark.parametrize("seed", range(3))
def test_the_odd_ranks_are_those_outside_the_strict_largest_group_of_equal_digests(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(400):
        n, tensors = rng.randint(2, 9), rng.randint(1, 5)
        ranks = sorted(rng.sample(range(64), n))
        base = [(rng.randrange(5), rng.randrange(5)) for _ in range(tensors)]
        rows = [list(base) for _ in range(n)]
        for i in range(n):  # some replicas differ in some tensors, drawn from few values (ties happen)
            for k in range(tensors):
                if rng.random() < 0.2:
                    rows[i][k] = (rng.randrange(3), 9)
        found = disagreement(rows, ranks)
        differing = [k for k in range(tensors) if len({row[k] for row in rows}) > 1]
        if not differing:
            assert found is None
            continue
        assert found is not None
        k, differ, agree = found
        assert k == differing[0]
        assert sorted(differ + agree) == ranks and not set(differ) & set(agree)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(row[k], []).append(ranks[i])
        sizes = sorted((len(g) for g in groups.values()), reverse=True)
        if sizes[0] == sizes[1]:
            assert agree == [] and differ == ranks  # no majority: every rank is named
        else:
            assert agree == max(groups.values(), key=len) and len({rows[ranks.index(r)][k] for r in agree}) == 1


def _rows_of(r: int, shape: list[int], layouts: list[list[list[int]]],
             digest_of: dict[tuple[int, int, int], tuple[int, int]]) -> state_check.ReplicaRows:
    """Rank ``r``'s payload as replica_rows lays it out (``shape``: its count of tensors per group)."""
    groups, flat = [], []
    for g, parts in enumerate(layouts):
        ranks = next(p for p in parts if r in p)
        live = len(ranks) >= 2 and shape[g] > 0
        groups.append((f"g{g}", ranks if live else [], [f"t{k}" for k in range(shape[g])] if live else []))
        if live:
            flat += [x for k in range(shape[g]) for x in digest_of.get((r, g, k), (7, 7))]
    header = [len(groups), *(len(names) for _, _, names in groups)]
    return state_check.ReplicaRows(groups, torch.tensor(header + flat, dtype=torch.int64))


@pytest.mark.parametrize("seed", range(3))
def test_rows_compared_off_the_training_thread_give_the_verdict_of_a_per_group_gather(seed: int) -> None:
    """The memory tier lays every group's digests into one payload per rank and compares them after a world-wide
    gather (``replica_rows`` / ``compare_rows``): on generated layouts (two partitions of the world into replica
    groups, like dp_cp and edp; some ranks' tensors perturbed, some groups without tensors) the verdict equals
    ``disagreement`` over each group's rows; a rank whose payload has another count of tensors is odd."""
    rng = random.Random(seed)
    for _ in range(100):
        world = rng.choice((2, 4, 6, 8))
        layouts = []
        for _g in range(2):
            size = rng.choice([d for d in (1, 2, world // 2, world) if d >= 1 and world % d == 0])
            perm = list(range(world))
            rng.shuffle(perm)
            layouts.append([sorted(perm[i:i + size]) for i in range(0, world, size)])
        counts = [rng.randint(0, 3) for _ in layouts]
        base = {(g, k, m): (rng.randrange(1 << 40), rng.randrange(1 << 40)) for g in range(2) for k in range(counts[g])
                for m in range(world)}  # per group, tensor and replica set
        digest_of = {}
        for r in range(world):
            for g, parts in enumerate(layouts):
                group = next(p for p in parts if r in p)
                for k in range(counts[g]):
                    value = base[(g, k, group[0])]
                    if rng.random() < 0.08:
                        value = (value[0] + 1, value[1])  # this replica diverged
                    digest_of[(r, g, k)] = value

        odd_shape = rng.randrange(world) if rng.random() < 0.2 else None
        rows = {r: _rows_of(r, [c + (1 if r == odd_shape else 0) for c in counts], layouts, digest_of)
                for r in range(world)}
        payloads = {r: rows[r].payload.tolist() for r in range(world)}
        for r in range(world):
            got = {d.group: d for d in state_check.compare_rows(rows[r], payloads)}
            for g, parts in enumerate(layouts):
                ranks = next(p for p in parts if r in p)
                if len(ranks) < 2 or counts[g] + (1 if r == odd_shape else 0) == 0:
                    assert f"g{g}" not in got
                    continue
                if odd_shape in ranks:
                    assert f"g{g}" in got and (odd_shape in got[f"g{g}"].differ or not got[f"g{g}"].agree)
                    continue
                want = disagreement([[digest_of[(m, g, k)] for k in range(counts[g])] for m in ranks], ranks)
                if want is None:
                    assert f"g{g}" not in got
                else:
                    d = got[f"g{g}"]
                    assert (d.tensor, d.differ, d.agree) == (f"t{want[0]}", want[1], want[2])
