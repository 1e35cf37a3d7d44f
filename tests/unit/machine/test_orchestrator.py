"""The orchestrator on a one-rank context in this process: phase order from the graph, the failure edge,
exit codes."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lifecycle.machine import graph
from lifecycle.machine.orchestrator import Orchestrator
from lifecycle.obs.events import read_events
from tests.unit.onerank import MakeCtx

pytestmark = pytest.mark.timeout(60)


def _phases(ctx) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
    return [(e["name"].split(":", 1)[1], bool(e.get("failure"))) for e in read_events(ctx.run_dir)[0]
            if e["kind"] == "begin" and e["name"].startswith("phase:")]


def _exit(ctx) -> dict:  # type: ignore[no-untyped-def, type-arg]
    return [e for e in read_events(ctx.run_dir)[0] if e["name"] == "exit"][-1]


def test_a_clean_run_follows_the_main_path_with_the_checkpoint_loop(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"train": {"steps": 2}, "checkpoint": {"every_steps": 1, "at_end": False}})
    assert Orchestrator(ctx).run() == 0
    assert not dist.is_initialized()
    got = [p for p, _ in _phases(ctx)]
    assert got == ["init", "warmup", "train", "checkpoint", "train", "checkpoint", "train", "teardown"]
    assert list(dict.fromkeys(p for p in got if p != "checkpoint")) == list(graph.MAIN_PATH)
    assert _exit(ctx)["exit_code"] == 0 and _exit(ctx)["step"] == 2


def test_a_disabled_phase_is_skipped(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"warmup": {"enabled": False}, "train": {"steps": 0}})
    assert Orchestrator(ctx).run() == 0
    assert [p for p, _ in _phases(ctx)] == ["init", "train", "teardown"]


def test_a_raise_takes_the_failure_edge_with_the_rank_failed_code(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"faults": [{"at": "warmup", "ranks": [0], "action": "raise"}]})
    orchestrator = Orchestrator(ctx)
    assert orchestrator.run() == 4
    assert _phases(ctx) == [("init", False), ("warmup", False), ("teardown", True)]
    assert not dist.is_initialized()
    assert type(orchestrator.error).__name__ == "DrillError"
    failure = [e for e in read_events(ctx.run_dir)[0] if e["name"] == "failure"][0]
    assert failure["phase"] == "warmup" and failure["exit_code"] == 4


def test_a_policy_the_world_cannot_run_exits_2(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"parallelism": {"tp": 2}, "train": {"kind": "megatron_gpt", "steps": 1, "options": {}}})
    assert Orchestrator(ctx).run() == 2
    assert _phases(ctx) == [("init", False), ("teardown", True)]


def test_a_failing_teardown_step_ends_in_the_failure_path(make_ctx: MakeCtx) -> None:
    ctx = make_ctx({"train": {"steps": 0}, "faults": [{"at": "teardown", "ranks": [0], "action": "raise",
                                                       "op": "destroy_subgroups"}]})
    assert Orchestrator(ctx).run() == 4
    assert not dist.is_initialized()
    assert _exit(ctx)["exit_code"] == 4


def test_every_main_path_phase_has_a_handler(make_ctx: MakeCtx) -> None:
    orchestrator = Orchestrator(make_ctx())
    assert set(graph.MAIN_PATH) <= set(orchestrator.handlers)
    assert all(orchestrator.handlers[p].phase == p for p in graph.MAIN_PATH)
