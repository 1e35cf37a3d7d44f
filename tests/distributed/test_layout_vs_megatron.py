"""Layout.ranks_of against the groups real megatron-core builds on real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import init_gloo, run_ranks

pytestmark = pytest.mark.distributed


def _compare(rank: int, world: int, sizes: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from lifecycle.backends.megatron import parallel
    from lifecycle.distributed.layout import build_layout
    from lifecycle.distributed.names import GROUP_NAMES

    init_gloo(rank, world)
    parallel.initialize(**sizes, timeout_s=60)
    try:
        layout = build_layout(world, **{k: v for k, v in sizes.items() if k != "vpp"})
        got, mismatched = {}, {}
        for name in GROUP_NAMES:
            pg = parallel.get_group(name)
            got[name] = None if pg is None else dist.get_process_group_ranks(pg)
            if got[name] != layout.ranks_of(name, rank):
                mismatched[name] = (got[name], layout.ranks_of(name, rank))
        # Every process group object this rank holds (torch keeps one entry per group it is a member of).
        communicators = len(dist.distributed_c10d._world.pg_map)
        return {"mismatched": mismatched, "got": got, "communicators": communicators}
    finally:
        parallel.destroy()


def _check(world: int, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    results = run_ranks(_compare, world, 100, sizes)
    for rank, result in enumerate(results):
        assert result["mismatched"] == {}, f"rank {rank}: megatron vs layout {result['mismatched']}"
    return results


@pytest.mark.timeout(120)
def test_world8_tp2_pp2_ep2() -> None:
    results = _check(8, {"tp": 2, "pp": 2, "ep": 2})
    assert results[5]["got"]["pos_embd"] is None  # last stage: the getter asserts, we say None
    assert results[1]["got"]["pos_embd"] == [1]
    assert all(r["got"]["inter_dist_opt"] is None for r in results)


@pytest.mark.timeout(120)
def test_world4_tp2_ep2_etp1() -> None:
    results = _check(4, {"tp": 2, "ep": 2, "etp": 1})
    assert results[0]["got"]["etp"] == [0]
    assert results[0]["got"]["tp_ep"] == [0, 1]


@pytest.mark.timeout(120)
def test_world4_two_distributed_optimizer_instances() -> None:
    results = _check(4, {"dist_opt_instances": 2})
    assert [r["got"]["inter_dist_opt"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["got"]["intra_edp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
