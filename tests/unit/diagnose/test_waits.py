"""The group a verdict names is the first op of the culprit's own program that it never entered while its partners
wait there, not an op downstream of it (where ranks wait for ranks that themselves wait). The dumps are the
summaries of a world-6 plain loop (tp groups [0,1,2] [3,4,5], dp groups [0,3] [1,4] [2,5], a loss all-reduce on
the default group; each step runs tp, dp, default in that order), as jobs/plain_loop.py writes them."""

from __future__ import annotations

from lifecycle.diagnose import verdict, waits
from lifecycle.diagnose.facts import Dump, DumpOp, Evidence

TP = {"1": [0, 1, 2], "2": [3, 4, 5]}
DP = {"3": [0, 3], "4": [1, 4], "5": [2, 5]}
DESC = {"1": "tp", "2": "tp", "3": "dp", "4": "dp", "5": "dp"}


def _mine(groups: dict[str, list[int]], rank: int) -> str:
    return next(g for g, ranks in groups.items() if rank in ranks)


def _dump(rank: int, ops_done: int) -> Dump:
    """Rank ``rank`` entered the first ``ops_done`` ops of the program (3 a step: tp, dp, default)."""
    program = [_mine(TP, rank), _mine(DP, rank), "0"]
    ops = [DumpOp(program[i % 3], i // 3 + 1, "all_reduce", "[[16]]", i, "") for i in range(ops_done)]
    dump = Dump(rank, f"fr_trace_rank_{rank}", "2.10", "the file name", ops, world=6)
    for op in ops:
        dump.enq[op.group] = max(dump.enq.get(op.group, 0), op.seq)
    return dump


def _evidence(done: dict[int, int]) -> Evidence:
    ev = Evidence(world=6)
    ev.dumps = {r: _dump(r, n) for r, n in done.items()}
    ev.descs.update(DESC)
    ev.members = {g: tuple(r) for g, r in {**TP, **DP}.items()}
    # the job's layout as its user gives it (diagnose -w 6 -o ...): no pipeline, so no send or receive, which gloo
    # does not record, can hide where a rank waits
    ev.layout = {"tp": [TP["1"], TP["2"]], "dp": list(DP.values()), "pp": [[r] for r in range(6)]}
    return ev


def test_a_rank_stalled_after_its_tp_op_is_named_in_dp_where_its_partner_waits() -> None:
    # step 3: rank 4 entered tp (op 7) and stalled; rank 1 waits in dp [1,4]; the others went on to the loss
    # all-reduce on the default group and wait there for ranks 1 and 4
    ev = _evidence({0: 9, 1: 8, 2: 9, 3: 9, 4: 7, 5: 9})
    g = waits.graph(ev)
    assert g.roots == [4]
    v = verdict.decide(ev)
    assert v.culprits == [4] and v.cause == "never entered"
    assert (v.group, v.seq) == ("4", 3)
    assert verdict.as_json_group(ev, g, v) == {"name": "4", "desc": "dp", "ranks": [1, 4]}


def test_a_rank_stalled_before_its_step_is_named_in_tp_its_first_op() -> None:
    # step 2: rank 4 entered nothing; ranks 3 and 5 wait in tp, rank 1 in dp [1,4] (tp comes first)
    ev = _evidence({0: 5, 1: 5, 2: 5, 3: 4, 4: 3, 5: 4})
    v = verdict.decide(ev)
    assert v.culprits == [4] and (v.group, v.seq) == ("2", 2)


def test_without_the_layout_a_gloo_dump_proves_no_rank_free() -> None:
    # gloo records no send or receive: rank 4 may be blocked in one; it is a suspect until the layout says there is
    # no pipeline
    ev = _evidence({0: 9, 1: 8, 2: 9, 3: 9, 4: 7, 5: 9})
    ev.layout = None
    g = waits.graph(ev)
    assert g.roots == [] and 4 in g.hidden
    v = verdict.decide(ev, g)
    assert v.culprits == [] and v.suspects == [4]


def test_a_wait_downstream_of_a_waiting_rank_is_never_chosen_first() -> None:
    ev = _evidence({0: 9, 1: 8, 2: 9, 3: 9, 4: 7, 5: 9})
    g = waits.graph(ev)
    first = g.first_wait([4])
    assert first is not None and first.rank == 1 and first.missing == [4]
    assert g.waits[0].missing == [1, 4]
