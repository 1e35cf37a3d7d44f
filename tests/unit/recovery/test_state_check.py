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
