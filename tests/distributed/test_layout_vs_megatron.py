"""Layout.ranks_of, and the groups lifecycle makes with torch.distributed alone (NativeParallel, the synthetic
kind's), against the groups real megatron-core builds on real gloo ranks.

The layouts of ``test_explain_vs_megatron`` run through :func:`_check` too (one launch per layout serves both)."""

from __future__ import annotations

from typing import Any

import pytest

from tests._dist import init_gloo, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]


def _compare(rank: int, world: int, sizes: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from lifecycle.backends.megatron import parallel
    from lifecycle.distributed.layout import build_layout
    from lifecycle.policy.groupnames import GROUP_NAMES

    init_gloo(rank, world)
    native = _native_groups(rank, sizes)  # first: megatron must not be imported by it
    before = len(dist.distributed_c10d._world.pg_map)  # the default group and the torch-made ones
    parallel.initialize(**sizes, timeout_s=60)
    try:
        layout = build_layout(world, **{k: v for k, v in sizes.items() if k != "vpp"})
        got, mismatched = {}, {}
        for name in GROUP_NAMES:
            pg = parallel.get_group(name)
            got[name] = None if pg is None else dist.get_process_group_ranks(pg)
            if got[name] != layout.ranks_of(name, rank):
                mismatched[name] = (got[name], layout.ranks_of(name, rank))
            if native[name] != got[name]:
                mismatched[f"{name} (torch-made)"] = (got[name], native[name])
        # Every process group object this rank holds (torch keeps one entry per group it is a member of).
        communicators = 1 + len(dist.distributed_c10d._world.pg_map) - before
        return {"mismatched": mismatched, "got": got, "communicators": communicators}
    finally:
        parallel.destroy()


def _native_groups(rank: int, sizes: dict[str, Any]) -> dict[str, list[int] | None]:
    import sys

    import torch.distributed as dist

    from lifecycle.distributed.native import NativeParallel
    from lifecycle.policy.groupnames import GROUP_NAMES
    from lifecycle.policy.sections import ParallelismConfig

    preloaded = any(m.startswith("megatron") for m in sys.modules)  # the ranks' forkserver imported it (tests/_dist.py)
    native = NativeParallel()
    native.load()
    native.initialize(ParallelismConfig(**sizes), timeout_s=60)
    # In a fresh process too: tests/unit/distributed/test_layout.py::test_torch_made_groups_do_not_import_megatron
    assert preloaded or not any(m.startswith("megatron") for m in sys.modules), "NativeParallel imported megatron"
    out = {}
    for name in GROUP_NAMES:
        pg = native.get_group(name)
        out[name] = None if pg is None else dist.get_process_group_ranks(pg)
    # One object per distinct rank set: the default group's ranks are not made again.
    assert native.get_group("world") is dist.group.WORLD
    native.destroy()
    native.destroy()
    assert not native.is_initialized() and native.get_group("tp") is None
    return out


def _check(world: int, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    results = run_ranks(_compare, world, 100, sizes)
    for rank, result in enumerate(results):
        assert result["mismatched"] == {}, f"rank {rank}: megatron vs layout {result['mismatched']}"
    return results


@pytest.mark.timeout(120)
def test_world4_two_distributed_optimizer_instances() -> None:
    results = _check(4, {"dist_opt_instances": 2})
    assert [r["got"]["inter_dist_opt"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["got"]["intra_edp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
