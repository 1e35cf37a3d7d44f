"""The ``zero_tokens`` fault drill inside the real megatron-core model, with each zero-token guard action.

From step 3 the routers of rank 1's expert-parallel group send no token to rank 1's local experts, which
skip their GEMMs on empty input (``experts_skip_empty``, as TEGroupedMLP does), under the distributed
optimizer with two instances and ``overlap_grad_reduce``. At world 8 (ep2: the expert-dp group of rank 1 is
[1, 3] inside its instance) rank 1's expert gradients are then never ready, so rank 1 skips the expert
bucket's reduce-scatter that rank 3 waits in, and goes on to its dense bucket, which rank 3 never reaches:
a deadlock. Megatron-core's own check ("Communication call has not been issued for this bucket") does not
run with more than one instance.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.distributed.runs import FAST, Run, lifecycle_run

pytestmark = pytest.mark.distributed
STEP_DEADLINE = 20.0  # FAST's watchdog.deadlines.step
DRILL = [*FAST, "parallelism.ep=2", "parallelism.dist_opt_instances=2", "train.options.use_distributed_optimizer=true",
         "train.options.overlap_grad_reduce=true", "train.options.experts_skip_empty=true", "train.steps=5",
         "checkpoint.every_steps=0", "checkpoint.at_end=false",
         "+faults=[{at: train, ranks: [1], action: zero_tokens, step: 3}]"]


def _fired(run: Run) -> float:
    return next(e["t"] for e in run.events()[1] if e["name"] == "fault_drill") / 1e6


def _steps(run: Run, rank: int) -> dict[int, dict]:  # type: ignore[type-arg]
    return {e["step"]: e for e in run.events()[rank] if e["name"] == "step" and e["kind"] == "end" and e["outcome"] == "ok"}


@pytest.mark.timeout(150)
def test_without_a_guard_the_job_deadlocks_and_the_watchdog_names_step_groups_and_ranks(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 8, *DRILL, "moe.zero_token.action=off", timeout=140)
    assert run.code == 3, run.output  # the job hangs at the skipped reduction: the watchdog names it, hang code
    # Which rank writes hang_report.json depends on who leaves first (a rank that saw the divergence exits with
    # the hang code at once, its peers then see it gone): the divergence itself is in the ranks' reports.
    report = (run.run_dir / "hang_report.json").read_text()
    assert '"phase": "train"' in report and '"cause": "' in report
    out = run.output
    assert "COLLECTIVE SEQUENCE MISMATCH in phase train: ranks 1 and 3 wait for each other" in out, out
    assert "rank 3 is in grad_reduce on group intra_edp" in out and "rank 1 is in grad_reduce on group intra_dp_cp" in out
    # The step and group of each stuck rank; a rank whose collective then broke (its peer aborted) may be shown
    # back in its step span, so at least one of the two keeps its grad_reduce.
    stuck = re.findall(r"stuck: rank ([13]) \[\w+\]: phase train step 3, in op (\S+) on group (\S+) ", out)
    assert {r for r, _, _ in stuck} == {"1", "3"}, out
    assert {("1", "grad_reduce", "intra_dp_cp"), ("3", "grad_reduce", "intra_edp")} & set(stuck), out
    fired = _fired(run)
    for rank, evs in run.events().items():
        assert max(_steps(run, rank)) == 2, rank  # nobody finished step 3
        last = max(e["t"] for e in evs if e["name"] == "exit") / 1e6
        assert last - fired < STEP_DEADLINE, (rank, last - fired)  # named before the step deadline


@pytest.mark.megatron
@pytest.mark.timeout(150)
def test_dummy_forward_trains_on_with_finite_gradients(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 8, *DRILL, "moe.zero_token.action=dummy_forward", timeout=140)
    assert run.code == 0, run.output
    steps = _steps(run, 1)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert all(math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 for s in steps.values()), steps
    assert steps[5]["loss"] < steps[1]["loss"] - 0.5
    events = run.events()
    zero = [(e["step"], e["layer"]) for e in events[1] if e["name"] == "zero_token"]
    assert sorted(zero) == [(s, f"decoder.layers.{i}.mlp.experts") for s in (3, 4, 5) for i in (0, 1)], zero
    assert not any(e["name"] == "zero_token" for r in (0, 2, 3) for e in events[r])
    # The starved rank still joins every expert gradient reduction of its expert-dp group [1, 3].
    reduces = {r: [e["step"] for e in events[r] if e["name"] == "grad_reduce" and e["kind"] == "end"
                   and e["group"] == "intra_edp"] for r in (1, 3)}
    assert reduces[1] == reduces[3] and set(reduces[1]) == {1, 2, 3, 4, 5}, reduces


@pytest.mark.timeout(90)
def test_error_exits_4_naming_rank_layer_and_step(tmp_path: Path) -> None:
    run = lifecycle_run(tmp_path, 4, *DRILL, "moe.zero_token.action=error", timeout=80)
    assert run.code == 4, run.output
    assert "rank 1 failed first" in run.output, run.output
    assert "rank 1: MoE layer decoder.layers.0.mlp.experts received no tokens at step 3" in run.output, run.output
