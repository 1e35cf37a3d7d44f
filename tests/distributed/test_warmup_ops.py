"""Warmup collectives on every resolved megatron group, and a skipped op turning into a HangError."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests._dist import init_gloo, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]

DEADLINE_S = 2.5


def _all_ops(rank: int, world: int) -> dict[str, Any]:
    from lifecycle.backends.megatron import parallel
    from lifecycle.distributed.collectives import OPS
    from lifecycle.distributed.groups import resolve
    from lifecycle.errors import PhaseError

    init_gloo(rank, world)
    parallel.initialize(tp=2, ep=2, timeout_s=60)
    try:
        groups = resolve(parallel.MegatronParallel(), "all")
        took = {}
        for g in groups:
            for op_name, op in OPS.items():
                took[(g.label, op_name)] = op(g.pg, g.ranks, 20.0, group_name=g.label)
        try:
            resolve(parallel.MegatronParallel(), ["tp"], required=["inter_dist_opt"])
            required_error = None
        except PhaseError as exc:
            required_error = (str(exc), exc.group)
        return {"groups": [(g.names, g.ranks) for g in groups], "took": took,
                "required_error": required_error}
    finally:
        parallel.destroy()


@pytest.mark.timeout(120)
def test_every_op_on_every_resolved_group() -> None:
    results = run_ranks(_all_ops, 4, 100)
    labels = [[names for names, _ in r["groups"]] for r in results]
    assert all(lab == labels[0] for lab in labels), "every rank must resolve the same sequence"
    by_name = {names: ranks for names, ranks in results[1]["groups"]}
    # One communicator each, under every name Megatron hands it out as.
    assert by_name[("edp", "intra_edp")] == [1]
    assert by_name[("world",)] == [0, 1, 2, 3]
    assert by_name[("dp",)] == [1, 3] and by_name[("dp_gloo",)] == [1, 3]
    assert not any("inter_dist_opt" in names for names in by_name)
    assert all(len(r["took"]) == 5 * len(labels[0]) for r in results)
    message, group = results[0]["required_error"]
    assert group == "inter_dist_opt" and "required group 'inter_dist_opt'" in message


def _skip_one(rank: int, world: int) -> dict[str, Any]:
    import datetime

    from torch.distributed.distributed_c10d import _get_default_store

    from lifecycle.backends.megatron import parallel
    from lifecycle.distributed.collectives import all_reduce
    from lifecycle.distributed.groups import resolve
    from lifecycle.errors import HangError

    init_gloo(rank, world)
    parallel.initialize(tp=2, timeout_s=60)
    store = _get_default_store()
    try:
        (dp,) = resolve(parallel.MegatronParallel(), ["dp"])
        if rank == 1:
            start = time.monotonic()
            try:
                return {"ok": all_reduce(dp.pg, dp.ranks, DEADLINE_S, group_name=dp.label)}
            except HangError as exc:
                return {"hang": str(exc), "group": exc.group, "deadline_s": exc.deadline_s,
                        "rank": exc.rank, "after_s": time.monotonic() - start}
            finally:
                store.set("reported", "1")
        if rank != 3:  # rank 3 is the straggler: it never joins the all_reduce
            all_reduce(dp.pg, dp.ranks, DEADLINE_S, group_name=dp.label)
        # Stay connected until rank 1 has its verdict: a peer that left early would turn the timeout
        # into a "connection closed" error, and rank 0 hosts the store.
        store.wait(["reported"], datetime.timedelta(seconds=30))
        return {"ok": rank != 3}
    finally:
        parallel.destroy()


@pytest.mark.timeout(120)
def test_a_skipped_op_is_a_hang_error_naming_the_group() -> None:
    results = run_ranks(_skip_one, 4, 90)
    # tp=2 at world 4: dp groups are [0, 2] and [1, 3]; only rank 3's partner waits in vain.
    assert results[0] == {"ok": True} and results[2] == {"ok": True} and results[3] == {"ok": False}
    hang = results[1]
    assert hang.get("group") == "dp", hang
    assert hang["rank"] == 1 and hang["deadline_s"] == DEADLINE_S
    assert "all_reduce on group 'dp' (ranks [1, 3])" in hang["hang"]
    assert DEADLINE_S - 0.1 <= hang["after_s"] < DEADLINE_S + 2.0


def _pipeline_p2p(rank: int, world: int) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from lifecycle.backends.megatron import parallel
    from lifecycle.distributed.collectives import pipeline_neighbours, pipeline_p2p
    from lifecycle.distributed.groups import resolve

    init_gloo(rank, world)
    out: dict[str, Any] = {}
    for vpp in (None, 2):
        parallel.initialize(pp=world, vpp=vpp, timeout_s=60)
        try:
            (pp,) = resolve(parallel.MegatronParallel(), ["pp"])
            pipeline_p2p(pp.pg, pp.ranks, 20.0, group_name=pp.label, interleaved=vpp is not None)
            # Megatron's schedule sends to these ranks (its P2PCommunicator wraps around on every stage).
            out[str(vpp)] = {"ours": list(pipeline_neighbours(pp.ranks, rank, interleaved=vpp is not None)),
                             "megatron": [ps.get_pipeline_model_parallel_prev_rank(),
                                          ps.get_pipeline_model_parallel_next_rank()],
                             "first": ps.is_pipeline_first_stage(), "last": ps.is_pipeline_last_stage()}
        finally:
            parallel.destroy()
    return out


@pytest.mark.timeout(120)
def test_pipeline_p2p_exchanges_with_the_schedules_neighbours() -> None:
    results = run_ranks(_pipeline_p2p, 4, 100)
    for vpp in ("None", "2"):
        for rank, both in enumerate(results):
            r = both[vpp]
            prev, nxt = r["megatron"]
            if vpp == "None":  # 1F1B never sends from the last stage to the first
                prev = None if r["first"] else prev
                nxt = None if r["last"] else nxt
            assert r["ours"] == [prev, nxt], (vpp, rank, r)
    assert results[0]["None"]["ours"] == [None, 1] and results[0]["2"]["ours"] == [3, 1]
    assert results[3]["None"]["ours"] == [2, None] and results[3]["2"]["ours"] == [2, 0]
