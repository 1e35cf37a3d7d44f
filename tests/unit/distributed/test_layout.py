"""The pure-Python group layout: known layouts, errors, speed at 16k ranks, and Megatron as the oracle."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.distributed.layout import MAX_WORLD_SIZE, Layout, RankSet, build_layout, chunk
from lifecycle.distributed.ranks import fmt_ranks
from lifecycle.errors import UsageError
from lifecycle.policy.groupnames import GROUP_NAMES

ROOT = Path(__file__).resolve().parents[3]


def test_tp2_pp2_ep2_world8_rank5() -> None:
    lay = build_layout(8, tp=2, pp=2, ep=2)
    assert (lay.dp, lay.edp, lay.etp) == (2, 1, 2)
    assert lay.ranks_of("tp", 5) == [4, 5]
    assert lay.ranks_of("dp", 5) == [5, 7]
    assert lay.ranks_of("pp", 5) == [1, 5]
    assert lay.ranks_of("mp", 5) == [0, 1, 4, 5]
    assert lay.ranks_of("ep", 5) == [5, 7]
    assert lay.ranks_of("edp", 5) == [5]
    assert lay.ranks_of("tp_ep", 5) == [4, 5, 6, 7]
    assert lay.ranks_of("embd", 5) == [1, 5]
    assert lay.ranks_of("pos_embd", 5) is None  # last stage: Megatron gives it no such group
    assert lay.ranks_of("pos_embd", 1) == [1]
    assert lay.ranks_of("inter_dist_opt", 5) is None
    assert lay.groups("inter_dist_opt") == []
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("dp_gloo") == lay.groups("dp")


def test_middle_pipeline_stage_has_no_embedding_group() -> None:
    lay = build_layout(4, pp=4)
    assert lay.groups("embd") == [[0, 3]]
    assert [lay.ranks_of("embd", r) for r in range(4)] == [[0, 3], None, None, [0, 3]]
    assert build_layout(2).groups("embd") == [[0], [1]]  # pp = 1: every rank embeds alone


def test_distributed_optimizer_instances() -> None:
    lay = build_layout(8, ep=2, dist_opt_instances=2)  # edp = 4, two instances of 2
    assert lay.groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.groups("intra_edp") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert lay.groups("inter_dist_opt") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert lay.groups("intra_dist_opt") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.ranks_of("inter_dist_opt", 6) == [2, 6]
    assert lay.groups("intra_dp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the dense dp (8) in two instances


@pytest.mark.megatron
@pytest.mark.parametrize("gtp", [False, True], ids=["megatron-core<0.19", "megatron-core>=0.19"])
def test_distinct_groups_merge_aliases(gtp: bool) -> None:
    lay = build_layout(4, tp=2, ep=2, gtp=gtp)
    distinct = dict((tuple(names), ranks) for names, ranks in lay.distinct_groups_of(1))
    expert = ("tp_ep", "tp_ep_pp", "tp_ep_pp_egtp") if gtp else ("tp_ep", "tp_ep_pp")
    assert distinct[("world", "tp_dp", "tp_dp_cp", *expert, "intra_dist_opt")] == [0, 1, 2, 3]
    assert distinct[("dp", "dp_cp", "ep", "intra_dp_cp", "dp_gloo", "dp_cp_gloo")] == [1, 3]
    named = [n for names, _ in lay.distinct_groups_of(1) for n in names]
    absent = ("inter_dist_opt",) if gtp else ("inter_dist_opt", "tp_ep_pp_egtp")
    assert sorted(named) == sorted(n for n in GROUP_NAMES if n not in absent)
    # 0.19 makes three more process groups per rank: two one-rank GTP groups and tp_ep_pp_egtp
    assert lay.communicators_of(1) == build_layout(4, tp=2, ep=2, gtp=False).communicators_of(1) + 3 * gtp


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"world_size": 6, "tp": 2, "pp": 2}, r"world size 6 is not divisible by tp\*pp\*cp = 4 \(tp=2, pp=2, cp=1\)"),
    ({"world_size": 8, "tp": 2, "ep": 8}, r"world size 8 is not divisible by etp\*ep\*pp = 16"),
    ({"world_size": 8, "tp": 4, "dist_opt_instances": 4}, r"dp\*cp 2 is not divisible by dist_opt_instances = 4"),
    ({"world_size": 8, "ep": 4, "dist_opt_instances": 4}, r"expert dp .* 2 is not divisible"),
    ({"world_size": 8, "tp": 0}, r"integers >= 1"),
    ({"world_size": 8, "ep": 2, "order": "tp-pp-dp"}, r"lacks \['ep'\]"),
    ({"world_size": 8, "order": "tp-xp-dp"}, r"must be distinct dims"),
    ({"world_size": 8, "pp": 2, "ep": 2, "order": "tp-cp-ep-pp-dp"}, r"dp \(4\) must equal expert dp \(2\)"),
])
def test_impossible_layouts_raise_usage_error(kwargs: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        build_layout(**kwargs)


def test_bad_name_and_rank() -> None:
    lay = build_layout(4)
    with pytest.raises(UsageError, match="did you mean 'edp'"):
        lay.ranks_of("edpp", 0)
    with pytest.raises(UsageError, match="rank 4 is outside world size 4"):
        lay.ranks_of("tp", 4)


def test_16384_ranks_is_fast() -> None:
    start = time.perf_counter()
    lay = build_layout(16384, tp=8, pp=8, ep=8, dist_opt_instances=2)
    for rank in (0, 9999, 16383):
        for name in GROUP_NAMES:
            lay.ranks_of(name, rank)
        lay.distinct_groups_of(rank)
    assert time.perf_counter() - start < 2.0
    assert lay.ranks_of("tp_ep_pp", 9999) == sorted(lay.ranks_of("tp_ep_pp", 9999) or [])
    assert len(lay.ranks_of("intra_dist_opt", 0) or []) == 16384 // 2


def test_explain_path_does_not_import_torch() -> None:
    code = ("import sys, lifecycle.distributed.layout as L; L.build_layout(64, tp=2, pp=2, ep=4).groups('edp');"
            "assert 'torch' not in sys.modules and 'megatron' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_torch_made_groups_do_not_import_megatron() -> None:
    """The torch-only groups' creator (train kinds with ``groups: torch``) runs on a machine without megatron-core:
    loading it, making the groups and destroying them imports none of it (a fresh process, world 1)."""
    code = ("import sys, datetime, torch.distributed as dist;"
            "from lifecycle.distributed.native import NativeParallel;"
            "from lifecycle.policy.sections import ParallelismConfig;"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1,"
            " timeout=datetime.timedelta(seconds=30));"
            "n = NativeParallel(); n.load(); n.initialize(ParallelismConfig(), timeout_s=30);"
            "assert n.get_group('world') is dist.group.WORLD; n.destroy(); dist.destroy_process_group();"
            "bad = sorted(m for m in sys.modules if m.startswith('megatron')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


# Megatron's own initialize_model_parallel as the oracle, without processes: its group factory is
# swapped for one that records (kind, ranks). Sorted ranks = the communicator order of new_group.
_DESC = {
    "DATA_PARALLEL_GROUP_WITH_CP": "dp_cp", "DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp_gloo",
    "DATA_PARALLEL_GROUP": "dp", "DATA_PARALLEL_GROUP_GLOO": "dp_gloo", "CONTEXT_PARALLEL_GROUP": "cp",
    "MODEL_PARALLEL_GROUP": "mp", "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp", "EMBEDDING_GROUP": "embd",
    "POSITION_EMBEDDING_GROUP": "pos_embd", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp", "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep", "EXPERT_TENSOR_PARALLEL_GROUP": "etp",
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep",
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp", "EXPERT_DATA_PARALLEL_GROUP": "edp",
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP": "tp_ep_pp_egtp",  # megatron-core 0.19+
    "EXPERT_DATA_PARALLEL_GROUP_GLOO": "edp_gloo",
    "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L0": "intra_edp",
    "HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L1": "inter_dist_opt",
    "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt",
    "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": "intra_dp_cp",
}


def _megatron_groups(monkeypatch: pytest.MonkeyPatch, world: int, **sizes: object) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    made: dict[str, list[list[int]]] = {"world": [list(range(world))]}

    def record(ranks: list[int], group_desc: str | None = None, **_: object) -> object:
        if group_desc in _DESC:
            made.setdefault(_DESC[group_desc], []).append(sorted(ranks))
        return object()

    with monkeypatch.context() as m:
        m.setattr(ps, "create_group", record)
        m.setattr(dist, "is_initialized", lambda: True)
        m.setattr(dist, "get_world_size", lambda *a, **k: world)
        m.setattr(dist, "get_rank", lambda *a, **k: 0)
        try:
            ps.initialize_model_parallel(**sizes)  # type: ignore[arg-type]
        finally:
            ps.destroy_model_parallel()
    made.setdefault("intra_edp", made["edp"])  # one instance: Megatron reuses the edp group
    made.setdefault("intra_dp_cp", made["dp_cp"])  # ... and the dp_cp group
    return made


@pytest.mark.megatron
@pytest.mark.parametrize(("world", "tp", "pp", "cp", "ep", "etp", "inst", "order"), [
    (8, 2, 2, 1, 2, None, 1, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 2, 2, 1, 2, "tp-cp-ep-dp-pp"),
    (24, 1, 3, 2, 4, 2, 1, "tp-cp-ep-dp-pp"),
    (32, 2, 2, 1, 4, 1, 4, "tp-cp-ep-dp-pp"),
    (16, 2, 2, 1, 2, 1, 2, "tp-cp-ep-pp-dp"),
    (12, 2, 3, 1, 1, None, 2, "tp-pp-dp"),
])
def test_matches_megatron_rank_generator(monkeypatch: pytest.MonkeyPatch, world: int, tp: int,
                                         pp: int, cp: int, ep: int, etp: int | None, inst: int,
                                         order: str) -> None:
    pytest.importorskip("megatron.core.parallel_state")
    ref = _megatron_groups(monkeypatch, world, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=pp, context_parallel_size=cp,
                           expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                           num_distributed_optimizer_instances=inst, order=order)
    lay = build_layout(world, tp, pp, cp, ep, etp, inst, order)
    for name in GROUP_NAMES:
        assert lay.groups(name) == ref.get(name, []), name
        for rank in range(world):
            assert lay.ranks_of(name, rank) == next((g for g in ref.get(name, []) if rank in g), None)


# Any world size: one rank's groups and the distinct-group count cost O(1), checked against full listings.
_ORDERS = ["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp", "pp-tp-dp", "dp-tp-pp", "ep-tp-pp-dp-cp",
           "cp-dp-ep-pp-tp"]


def _small_layouts(n: int) -> list[Layout]:
    rng = random.Random(11)
    out: list[Layout] = []
    while len(out) < n:
        world = rng.choice([1, 2, 4, 6, 8, 12, 16, 24, 32, 48])
        sizes = {"tp": rng.choice([1, 2, 3, 4]), "pp": rng.choice([1, 2, 3, 4]), "cp": rng.choice([1, 2]),
                 "ep": rng.choice([1, 2, 4]), "etp": rng.choice([None, 1, 2]),
                 "dist_opt_instances": rng.choice([1, 2, 4]), "order": rng.choice(_ORDERS)}
        try:
            out.append(build_layout(world, **sizes))  # type: ignore[arg-type]
        except UsageError:
            continue
    return out


@pytest.mark.timeout(60)
def test_group_of_and_distinct_count_equal_the_full_listing() -> None:
    for lay in _small_layouts(120):
        listed = {name: lay.groups(name) for name in GROUP_NAMES}
        assert lay.count_distinct_groups() == len({tuple(g) for gs in listed.values() for g in gs}), lay
        for name, groups in listed.items():
            for rank in range(lay.world_size):
                ref = next((g for g in groups if rank in g), None)
                got = lay.group_of(name, rank)
                assert (None if got is None else list(got)) == ref, (lay, name, rank)
                if got is not None:
                    assert got.size == len(ref or []) and got.fmt() == fmt_ranks(ref or [])


def test_rankset_membership_order_and_text() -> None:
    rs = RankSet.of(3, [(8, 4), (1, 2), (2, 1), (64, 3)])  # size-1 dims drop; sorted by stride
    ranks = [3 + a + 8 * b + 64 * c for c in range(3) for b in range(4) for a in range(2)]
    assert rs.dims == ((1, 2), (8, 4), (64, 3)) and list(rs) == sorted(ranks) and rs.size == 24
    assert all(r in rs for r in ranks) and not any(r in rs for r in set(range(-5, 300)) - set(ranks))
    assert RankSet.of(0, [(1, 4), (4, 2)]) == RankSet.of(0, [(1, 8)])  # merged: equal sets, equal objects
    assert rs.fmt() == fmt_ranks(ranks) and rs.fmt(limit=3) == fmt_ranks(ranks, limit=3)
    big = RankSet.of(7, [(8, 10**8)])
    assert big.fmt() == "7,15,...,799999999" and big.last == 799999999 and 799999999 in big and 8 not in big


@pytest.mark.timeout(30)
def test_the_largest_world_is_constant_time() -> None:
    start = time.perf_counter()
    lay = build_layout(2**30, tp=8, pp=4, ep=8, dist_opt_instances=4)
    for rank in (0, 123_456_789, lay.world_size - 1):
        groups = {n: lay.group_of(n, rank) for n in GROUP_NAMES}
        assert all(g is None or rank in g for g in groups.values())
    assert lay.group_of("world", 5) == RankSet(0, ((1, 2**30),))
    assert lay.count_distinct_groups() > 2**30
    assert time.perf_counter() - start < 1.0
    with pytest.raises(UsageError, match="larger than 2147483647"):
        build_layout(MAX_WORLD_SIZE + 1)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_a_chunk_is_the_run_of_consecutive_ranks_it_names(data: st.DataObject) -> None:
    # The intra-instance dp_cp group: megatron slices each dp-cp group's ascending ranks into equal runs.
    sizes = data.draw(st.lists(st.sampled_from([2, 3, 4]), min_size=1, max_size=3))
    dims, stride = [], data.draw(st.sampled_from([1, 2]))
    for n in sizes:
        dims.append((stride, n))
        stride *= n * data.draw(st.sampled_from([1, 2]))  # digits that never overlap, with or without gaps
    rs = RankSet.of(data.draw(st.integers(0, 5)), dims)
    ranks = list(rs)
    size = data.draw(st.sampled_from([d for d in range(1, rs.size + 1) if rs.size % d == 0]))
    for index in range(rs.size // size):
        try:
            got = chunk(rs, size, index)
        except UsageError:  # not a box of the dims (e.g. 3 ranks of 2 x 3): megatron's layouts never ask it
            assert any(size % n and n % size and size < rs.size for _, n in rs.dims), (rs, size)
            return
        assert list(got) == ranks[index * size:(index + 1) * size], (rs, size, index)
