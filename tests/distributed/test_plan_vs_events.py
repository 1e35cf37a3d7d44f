"""`lifecycle explain` lists exactly what runs (and the policy's NCCL environment reaches every rank): a real run's events, phase by phase, held against the plan each phase
states (2 real gloo ranks of ``lifecycle run``, the synthetic kind, with barrier points, periodic saves and the
sequence check).

For every phase and rank: each span the rank records in the phase (but the step handler's own, inside a step, its
setup, save or load) is an action of that phase's plan; the actions appear in the plan's order (first occurrences);
and every action that runs unconditionally did run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lifecycle.machine.plan import build_plan
from lifecycle.policy.load import read_resolved
from tests.distributed.runs import FAST, SYNTHETIC, lifecycle_run

pytestmark = pytest.mark.distributed


HANDLER_SPANS = {"step", "setup", "save", "resume"}
"""Spans whose inside is the step handler's own work (its collectives, e.g. ``grad_all_reduce``): not plan actions."""


def _spans_by_phase(events: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Phase -> the name of every span begun in it, in order, but those inside a step handler's span."""
    out: dict[str, list[str]] = {}
    phase: str | None = None
    stack: list[str] = []
    for e in events:
        name, kind = e["name"], e["kind"]
        if name.startswith("phase:"):
            phase, stack = (name.split(":", 1)[1] if kind == "begin" else None), []
            continue
        if phase is None:
            continue
        if kind == "begin":
            if not HANDLER_SPANS & set(stack):
                out.setdefault(phase, []).append(name)
            stack.append(name)
        elif kind == "end" and name in stack:
            del stack[len(stack) - 1 - stack[::-1].index(name):]
    return out


@pytest.mark.timeout(120)
def test_every_phase_runs_exactly_the_actions_its_plan_states(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 2, *SYNTHETIC, *FAST, "train.steps=4", "checkpoint.every_steps=2",
                        "+barriers.after_init=[{group: world}]", "+barriers.before_teardown=[{group: world}]",
                        "barriers.every_n_steps={n: 2, group: world}", "+barriers.after_checkpoint=[{group: dp}]",
                        "warmup.ops=[barrier,all_reduce]", "+distributed.nccl_env.NCCL_BUFFSIZE=2097152",
                        "+distributed.nccl_env.NCCL_PROTO='^LL128'")
    assert run.code == 0, run.output[-3000:]
    # The policy's NCCL environment reached every rank before its first process group (read back from os.environ).
    expected = {"NCCL_BUFFSIZE": "2097152", "NCCL_PROTO": "^LL128", "NCCL_RUNTIME_CONNECT": "0"}
    for rank, events in run.events().items():
        env = [e["env"] for e in events if e["name"] == "nccl_env"]
        assert env == [expected], (rank, env)
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["nccl_env"] == expected and summary["nccl_env_differs_on_ranks"] is None
    plan = build_plan(read_resolved(run.run_dir / "policy.resolved.yaml")).phases
    planned = {p: [a.span for a in actions if a.span] for p, actions in plan.items()}
    required = {p: [a.span for a in actions if a.span and not a.when] for p, actions in plan.items()}
    for rank, events in run.events().items():
        seen = _spans_by_phase(events)
        assert set(seen) == {"init", "warmup", "train", "checkpoint", "teardown"}, (rank, sorted(seen))
        for phase, spans in seen.items():
            names = spans
            unplanned = sorted({n for n in names if n not in planned[phase]})
            assert unplanned == [], f"rank {rank}, phase {phase}: spans its plan does not state: {unplanned}"
            first = list(dict.fromkeys(names))
            in_plan_order = [s for s in dict.fromkeys(planned[phase]) if s in first]
            assert first == in_plan_order, f"rank {rank}, phase {phase}: ran {first}, planned {planned[phase]}"
            missing = [s for s in required[phase] if s not in first]
            assert missing == [], f"rank {rank}, phase {phase}: planned but never ran: {missing}"
