"""store_barrier on 4 real gloo ranks: all arrive; a late rank is named within the deadline; the default
process group stays usable after a timeout."""

from __future__ import annotations

import time

import pytest

from tests._dist import init_gloo, run_ranks

pytestmark = pytest.mark.distributed

WORLD = 4
TIMEOUT_S = 2.0
LATE = 3


def _all_arrive(rank: int, world: int) -> int:
    from lifecycle.distributed.barrier import get_store, store_barrier

    init_gloo(rank, world)
    store = get_store()
    ranks = list(range(world))
    for seq in range(20):
        store_barrier(store, f"barrier/all/{seq}", rank, ranks, 10.0, group="world")
    # Disjoint subsets barrier independently with their own keys.
    half = [r for r in ranks if r % 2 == rank % 2]
    store_barrier(store, f"barrier/half{rank % 2}/0", rank, half, 10.0)
    return rank


@pytest.mark.timeout(60)
def test_all_ranks_arrive() -> None:
    assert run_ranks(_all_arrive, WORLD, 50.0) == list(range(WORLD))


def _one_late(rank: int, world: int) -> dict[str, object]:
    import torch
    import torch.distributed as dist

    from lifecycle.distributed.barrier import get_store, store_barrier
    from lifecycle.errors import HangError

    init_gloo(rank, world)
    store = get_store()
    ranks = list(range(world))
    store_barrier(store, "barrier/start/0", rank, ranks, 30.0)  # align the clocks of the next one
    if rank == LATE:
        time.sleep(TIMEOUT_S + 1.5)
    t0 = time.monotonic()
    out: dict[str, object] = {"missing": None}
    try:
        store_barrier(store, "barrier/after_init/0", rank, ranks, TIMEOUT_S, phase="init", group="world")
    except HangError as e:
        out.update(missing=e.missing, message=str(e), phase=e.phase)
    out["elapsed"] = time.monotonic() - t0
    t = torch.ones(1)
    dist.all_reduce(t)  # the default group still works after the barrier timed out
    out["sum"] = float(t.item())
    store_barrier(store, "barrier/end/0", rank, ranks, 30.0)  # and the store too
    return out


@pytest.mark.timeout(60)
def test_late_rank_is_named_and_group_stays_usable() -> None:
    results = run_ranks(_one_late, WORLD, 50.0)
    for rank, out in enumerate(results):
        assert out["missing"] == [LATE], (rank, out)
        assert out["phase"] == "init"
        assert out["sum"] == WORLD
        assert str(out["message"]).startswith(
            f"barrier 'barrier/after_init/0' on group 'world' timed out after {TIMEOUT_S}s: "
            f"ranks [{LATE}] did not arrive")
        if rank == LATE:
            assert float(out["elapsed"]) < 0.5  # the verdict is already in the store
        else:
            assert TIMEOUT_S - 0.1 <= float(out["elapsed"]) < TIMEOUT_S + 1.0, (rank, out)
