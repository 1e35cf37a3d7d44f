"""The phase graph, the plan and the fault drills, without processes."""

from __future__ import annotations

import pytest

from lifecycle.distributed.faults import Drills
from lifecycle.errors import DrillError, TransitionError
from lifecycle.machine import graph
from lifecycle.machine.plan import build_plan
from lifecycle.policy.load import validate


def test_graph_is_valid_and_legal_paths_pass() -> None:
    graph.validate_graph()
    path = [None, "init", "warmup", "train", "checkpoint", "train", "teardown"]
    for src, dst in zip(path, path[1:], strict=False):
        graph.check_transition(src, dst)


@pytest.mark.parametrize("src,dst,msg", [
    ("warmup", "checkpoint", "can't go to checkpoint from warmup"),
    (None, "train", "can't go to train before init"),
    ("teardown", "init", "can't go to init from teardown"),
    ("init", "checkpoint", "can't go to checkpoint from init"),
])
def test_illegal_transitions(src: str | None, dst: str, msg: str) -> None:
    with pytest.raises(TransitionError, match=msg):
        graph.check_transition(src, dst)


def test_failure_edge_from_every_phase() -> None:
    for phase in ("init", "warmup", "train", "checkpoint"):
        graph.check_transition(phase, "teardown", failure=True)
    with pytest.raises(TransitionError):
        graph.check_transition("warmup", "train", failure=True)


def test_a_trap_phase_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = dict(graph.TRANSITIONS, init=frozenset({"warmup", "train", "teardown"}),
                  checkpoint=frozenset({"train"}), train=frozenset({"checkpoint"}))
    monkeypatch.setattr(graph, "TRANSITIONS", broken)
    monkeypatch.setattr(graph, "FAILURE_EDGES", {})
    with pytest.raises(TransitionError, match="trap phases"):
        graph.validate_graph()


def test_plan_orders_and_skips() -> None:
    p = validate({"warmup": {"groups": ["edp", "world"], "ops": ["barrier", "p2p"], "order": "op_major"},
                  "train": {"steps": 0}})
    plan = build_plan(p).phases
    assert [(a.op, a.group) for a in plan["warmup"]] == [
        ("warm:barrier", "world"), ("warm:barrier", "edp"), ("warm:p2p", "world"), ("warm:p2p", "edp"),
        ("sequence_check", "world")]
    # train.steps=0: only the stop flag before the (absent) first step and the check when train is left
    assert [a.op for a in plan["train"]] == ["stop_flag", "sequence_check"] and plan["checkpoint"] == []
    assert plan["teardown"][-1].op == "hard_deadline"


@pytest.mark.parametrize(("checkpoint", "deadlines", "expect"), [
    ({}, {}, "max all-reduce of the preemption flag, every step, issued at a step's end, read at the next"),
    ({"signal_overlap": False, "signal_check_every": 5}, {}, "the preemption flag, every 5 steps, read at once"),
    ({"signal_check_every": "auto"}, {}, "the preemption flag, about every 0.5s of steps (auto: n from the slowest"),
    ({"on_signal": False}, {"step": "auto"}, "max all-reduce of the auto deadlines, every step"),
    ({"on_signal": False}, {}, None),  # nothing to agree on: no all-reduce at all
])
def test_plan_names_the_stop_flag_and_how_it_is_read(checkpoint: dict[str, object], deadlines: dict[str, object],
                                                     expect: str | None) -> None:
    p = validate({"checkpoint": checkpoint, "watchdog": {"deadlines": deadlines}})
    flags = [a for a in build_plan(p).phases["train"] if a.op == "stop_flag" and not a.when]
    if expect is None:
        assert flags == []
    else:
        assert len(flags) == 1 and flags[0].group == "world" and expect in flags[0].detail, flags


def test_drills_fire_once_on_matching_rank() -> None:
    p = validate({"faults": [{"at": "warmup", "ranks": [1], "action": "raise", "op": "all_reduce"},
                             {"at": "train", "step": 3, "ranks": [0, 1], "action": "skip"}]})
    assert Drills(p.faults, rank=2).pending == []
    d = Drills(p.faults, rank=1)
    assert d.fire("warmup", op="barrier") is False
    with pytest.raises(DrillError, match="fault drill: raise on rank 1 at phase warmup op all_reduce"):
        d.fire("warmup", op="all_reduce")
    assert d.fire("warmup", op="all_reduce") is False  # once only
    assert d.fire("train", step=2) is False and d.fire("train", step=3) is True
